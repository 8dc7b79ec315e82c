//! Arbitrary bytes as a Hugging Face config.json (see `pulsar::fuzz_checks::hf_config`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pulsar::fuzz_checks::hf_config(data));
