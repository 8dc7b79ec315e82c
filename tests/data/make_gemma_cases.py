"""Rebuilds tests/data/tokenizer_extra_cases.json: reference ids for the Gemma 3
tokenizer in gemma-3-270m-q4_k_m.gguf, made the way the shared oracle was made.

Needs a throwaway venv with `pip install gguf tokenizers transformers` (no torch):
  python make_gemma_cases.py /path/to/gemma-3-270m-q4_k_m.gguf

The vocabulary is read with `gguf`, turned into a tokenizer.json by
transformers' own GGUF converter, and the texts are encoded with `tokenizers`.
That route reproduces all 24 oracle cases. Two behaviours are left out on
purpose because there it departs from llama.cpp and SentencePiece (runs of
more than 31 spaces; a literal U+2581 in the text); tests/tokenizer.rs pins
those separately.
"""

import json
import random
import sys

from gguf import GGUFReader
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

OUT = __file__.rsplit("/", 1)[0] + "/tokenizer_extra_cases.json"

reader = GGUFReader(sys.argv[1])
fields = reader.fields
vocab = fields["tokenizer.ggml.tokens"].contents()
tokenizer_dict = {
    "tokenizer_type": "llama",
    "pre_tokenizer_type": "default",
    "tokens": vocab,
    "scores": fields["tokenizer.ggml.scores"].contents(),
    "token_type": fields["tokenizer.ggml.token_type"].contents(),
    "bos_token_id": 2, "eos_token_id": 1, "unk_token_id": 3, "pad_token_id": 0,
    "add_prefix_space": False,
}
tok, _ = convert_gguf_tokenizer("gemma3", tokenizer_dict)

NAMED = {
    "empty": "",
    "single_space": " ",
    "leading_spaces": "   hello",
    "six_spaces_between": "a      b",
    "many_newlines": "para one\n\n\n\n\n\npara two\n",
    "crlf_blank_lines": "a\r\n\r\nb",
    "python_indent": "def f(x):\n    if x:\n        return x * 2\n    return None\n",
    "html_tags": "<b>bold</b> and <i>italic</i> in <table><tr><td>cell</td></tr></table>",
    "byte_piece_literal": "the text <0x41> is not a byte token",
    "unused_literal": "<unused0> and <unused6241>",
    "image_markers": "<start_of_image>[multimodal]<end_of_image>",
    "eos_inside": "a<eos>b<pad>c",
    "combining_accent": "cafe\u0301 re\u0301sume\u0301",
    "arabic": "مرحبا بالعالم",
    "hindi": "नमस्ते दुनिया",
    "japanese": "東京は日本の首都です。",
    "emoji_zwj": "family: 👨‍👩‍👧‍👦 flag: 🇫🇷 skin: 👍🏽",
    "math_symbols": "∀x∈ℝ: x² ≥ 0 ⇒ √(x²) = |x|",
    "url": "https://example.com/path?q=1&r=two#frag",
    "long_word": "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "tabs_mixed": "\t \t\t  \tx",
    "numbers_commas": "1,000,000 and 3.14e-5 and -42",
    "chat_prompt": "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "lone_surrogate_free_rare": "\U0001F9EC \U0010FFFD x",
    "nul_run": "\u0000\u0000\u0000",
    "del_and_c1": "a\u007f\u0085\u009fb",
    "mixed_scripts": "Hello мир 世界 🌍!",
    "repeated_punct": "!!!??? ... ---- ____ ====",
    "trailing_newline_spaces": "end  \n  ",
}

rng = random.Random(2024)
WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "had not but one all their they has have been more who will would there can its also than into "
         "Paris Gemma tokenizer über naïve café façade Straße mañana señor "
         "мир привет Ελλάδα λόγος 日本 東京 中文 我们 한국어 안녕 नमस्ते مرحبا שלום ไทย").split()
BLOCKS = [(0x20, 0x7e), (0xa0, 0xff), (0x100, 0x17f), (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x6ff),
          (0x900, 0x97f), (0x3040, 0x30ff), (0x4e00, 0x9fff), (0xac00, 0xd7a3), (0x1f300, 0x1faff),
          (0x2000, 0x206f), (0x0, 0x1f), (0xe000, 0xe0ff), (0x10000, 0x1007f)]
SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "\n", "\n\n", "\t", "<b>", "</b>", "<0x41>", "<unused5>"]


def random_text():
    parts = []
    for _ in range(rng.randint(1, 25)):
        r = rng.random()
        if r < 0.45:
            parts.append(rng.choice(WORDS))
        elif r < 0.6:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 8))))
        elif r < 0.75:
            parts.append(rng.choice(".,;:!?()[]{}\"'-_/\\@#$%^&*+=<>|~`"))
        elif r < 0.9:
            lo, hi = rng.choice(BLOCKS)
            parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 4))))
        else:
            parts.append(rng.choice(SPECIALS))
        parts.append(rng.choice([" ", " ", " ", "", "  ", "   ", "\n", "    "]))
    return "".join(parts)


texts = list(NAMED.items()) + [(f"random_{i:03}", random_text()) for i in range(150)]
cases = []
for name, text in texts:
    ids = tok.encode(text, add_special_tokens=False).ids
    cases.append({"name": name, "text": text, "ids_no_special": ids, "ids_with_bos": [2] + ids,
                  "pieces": [vocab[i] for i in ids],
                  "roundtrip_ok": tok.decode(ids, skip_special_tokens=False) == text})
about = ("Extra Gemma 3 tokenizer cases made by tests/data/make_gemma_cases.py: ids from Hugging Face "
         "tokenizers on the tokenizer.json that transformers' GGUF converter builds from "
         "gemma-3-270m-q4_k_m.gguf (the route of shared/oracle/tokenizer_cases.json, which it reproduces). "
         "Pieces are the GGUF vocabulary's text of each id. random_* cases mix words, digits, punctuation, "
         "code points from many Unicode blocks, control-token text and runs of up to 4 spaces.")
with open(OUT, "w") as f:
    json.dump({"about": about, "cases": cases}, f, ensure_ascii=False, indent=1)
print(len(cases), "cases written to", OUT)
