//! Tokens whose role is known by their text rather than by the token types
//! a file gives them, the same way in every loader.

/// Tokens that end generation, as llama.cpp lists them for Gemma: EOS,
/// Gemma 1–3's `<end_of_turn>`, Gemma 4's `<turn|>`, and `<|tool_response>`,
/// which a Gemma 4 model writes after a tool call to wait for the result.
/// They are control tokens whatever the file says (Gemma 4's GGUF types
/// `<|tool_response>` user-defined); llama.cpp makes the same correction.
pub(crate) const END_OF_GENERATION: [&str; 4] =
    ["<eos>", "<end_of_turn>", "<turn|>", "<|tool_response>"];

/// Gemma 4's markers for thinking, tool calls and tool strings. The chat
/// parser reads them in the decoded text, so they must be rendered:
/// llama.cpp's converter types them user-defined, while Hugging Face's
/// `tokenizer.json` lists them as special added tokens; both loaders make
/// them user-defined. (`<|tool_response>` is then a control token all the
/// same, as an end of generation.)
pub(crate) const RENDERED_MARKERS: [&str; 7] = [
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    "<|\"|>",
];
