//! Arbitrary bytes as a GGUF file (see `pulsar::fuzz_checks::gguf`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pulsar::fuzz_checks::gguf(data));
