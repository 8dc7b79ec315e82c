//! Arbitrary bytes as a safetensors file (see `pulsar::fuzz_checks::safetensors`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pulsar::fuzz_checks::safetensors(data));
