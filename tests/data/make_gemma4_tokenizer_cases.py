"""Writes the reference ids for Pulsar's Gemma 4 tokenizer tests (tests/tokenizer_gemma4.rs).

The ids come from Hugging Face `tokenizers`, not from Pulsar. Needs, in a throwaway venv:
`pip install tokenizers gguf`. Run from the repository root:

    python tests/data/make_gemma4_tokenizer_cases.py

- gemma4_tokenizer/tiny_cases.json: `../shared/oracle/gemma4/tiny-tokenizer-512/tokenizer.json`
  (the 512-token stand-in in Gemma 4's layout) encoded by `tokenizers` itself.
- gemma4_tokenizer/vocab_cases.json: the real Gemma 4 vocabulary of
  `../shared/oracle/gemma4/ggml-vocab-gemma-4.gguf`, rebuilt as a tokenizer.json of the
  stand-in's layout (same vocabulary, merges in GGUF order, control and user-defined
  entries as added tokens) and encoded by `tokenizers`. That rebuilt file reproduces all
  46 of llama.cpp's own cases for this vocabulary (checked here before writing), so
  these extra cases (newline, tab and space runs, byte fallback, long text) come from an
  engine independent of both llama.cpp and Pulsar.

Every case is encoded without BOS; `decoded` is `decode(ids, skip_special_tokens=False)`.
"""

import json
import os

import gguf
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORACLE = os.path.join(ROOT, "..", "shared", "oracle", "gemma4")
OUT = os.path.join(ROOT, "tests", "data", "gemma4_tokenizer")

TINY_TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "Once upon a time, the random oracle spoke.",
    "print('hello')",
    "if x == 10:\n    return x",
    "  two leading spaces and trailing  ",
    "a\n\nb\n\n\nc\n",
    "\ttab\t\tend",
    "naïve café 日本 🦙",
    "<|turn>user\nHi there<turn|>\n<|turn>model\n",
    "<|channel>thought\nhmm<channel|>The answer",
    "<|tool_call>call:f{a:<|\"|>x<|\"|>}<tool_call|><|tool_response>",
    "<bos>not at the start<eos>",
    "",
    " ",
    "tokenizer merges against the random stand-in",
]

VOCAB_TEXTS = (
    ["\n" * n for n in (1, 2, 3, 30, 31, 32, 33, 62, 63, 70)]
    + ["\t" * n for n in (1, 2, 31, 32, 40)]
    + [" " * n for n in (1, 2, 31, 32, 40)]
    + [
        "a\n\n\n\nb",
        "x \n \n y",
        "line one\r\nline two\r\n",
        "\n\n\n\tindented\n    code",
        "\ue000\U000f0000 private use",
        "<|turn>user\nWrite a poem.<turn|>\n<|turn>model\n",
        "<|channel>thought\nLet me think.<channel|>Sure: <|tool_call>call:get{x:<|\"|>y<|\"|>}<tool_call|>",
        "Mixed: Ελληνικά, русский, עברית, हिन्दी, 中文, 日本語, 한국어, ไทย, emoji 🧑‍🚀🇩🇪.",
        "def f(x):\n\treturn x ** 2  # square\n\n\nprint(f(3))\n",
        "▁ a literal space mark ▁▁",
        "The quick brown fox jumps over the lazy dog. " * 40,
    ]
)


def cases(tok, texts):
    out = []
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False).ids
        out.append(
            {
                "name": f"case_{i}",
                "text": text,
                "ids": ids,
                "decoded": tok.decode(ids, skip_special_tokens=False),
            }
        )
    return out


def write(name, about, items):
    with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
        json.dump({"about": about, "cases": items}, f, ensure_ascii=False, indent=1)
        f.write("\n")


def rebuilt_real_tokenizer():
    reader = gguf.GGUFReader(os.path.join(ORACLE, "ggml-vocab-gemma-4.gguf"))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    with open(os.path.join(ORACLE, "tiny-tokenizer-512", "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": types[i] == 3}
        for i, t in enumerate(tokens) if types[i] in (3, 4)
    ]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(tokens)}
    spec["model"]["merges"] = [m.split(" ", 1) for m in merges]
    return Tokenizer.from_str(json.dumps(spec))


def check_llama_cpp_cases(tok):
    with open(os.path.join(ORACLE, "ggml-vocab-gemma-4.gguf.inp"), encoding="utf-8") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")
    with open(os.path.join(ORACLE, "ggml-vocab-gemma-4.gguf.out"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    for text, line in zip(texts, lines):
        want = [int(x) for x in line.split()]
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, (text, got, want)


def main():
    os.makedirs(OUT, exist_ok=True)
    tiny = Tokenizer.from_file(os.path.join(ORACLE, "tiny-tokenizer-512", "tokenizer.json"))
    write("tiny_cases.json", "ids from the tokenizers library on tiny-tokenizer-512/tokenizer.json",
          cases(tiny, TINY_TEXTS))
    real = rebuilt_real_tokenizer()
    check_llama_cpp_cases(real)
    write("vocab_cases.json",
          "ids from the tokenizers library on ggml-vocab-gemma-4.gguf rebuilt as a tokenizer.json",
          cases(real, VOCAB_TEXTS))


if __name__ == "__main__":
    main()
