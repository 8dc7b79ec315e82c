//! The real Gemma 3 tokenizer on arbitrary input (see
//! `pulsar::fuzz_checks::tokenizer`), loaded once from the default model or
//! PULSAR_MODEL.
#![no_main]

use pulsar::model::gguf::GgufFile;
use pulsar::tokenizer::Tokenizer;
use std::sync::OnceLock;

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = pulsar::model::fetch::default_model_path()
            .unwrap_or_else(|e| panic!("the tokenizer target needs the default model: {e:#}"));
        let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e:#}"));
        Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{e:#}"))
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| pulsar::fuzz_checks::tokenizer(tokenizer(), data));
