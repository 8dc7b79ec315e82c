//! Arbitrary bytes as a Hugging Face tokenizer.json or SentencePiece
//! tokenizer.model (see `pulsar::fuzz_checks::hf_tokenizer`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| pulsar::fuzz_checks::hf_tokenizer(data));
