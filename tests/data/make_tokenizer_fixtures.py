"""Rebuilds the small tokenizer fixtures in tests/data and their reference ids.

Needs `pip install sentencepiece tokenizers` (in a throwaway venv). The
reference ids come from those libraries, not from Pulsar:

- tiny_spm/, tiny_spm_prefix/: SentencePiece BPE models trained here on a
  small corpus (byte fallback, identity normalization, Gemma-like special
  ids; the second one with SentencePiece's dummy space prefix). Cases are
  encoded with `sentencepiece` itself.
- tiny_hf/: a Gemma-style tokenizer.json (BPE with merges, byte fallback,
  spaces written as U+2581, special and non-special added tokens) built from
  the tiny_spm vocabulary with `tokenizers`; cases are encoded with
  `tokenizers`.
"""

import io
import json
import os
import random

import sentencepiece as spm
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

HERE = os.path.dirname(os.path.abspath(__file__))

random.seed(7)
WORDS = ("the quick brown fox jumps over lazy dog token tokenizer merge piece byte fallback "
         "sentence model engine inference gemma pulsar kernel vector matrix tensor layer "
         "attention window rope cache prompt answer question turn user hello world over "
         "under between inside outside running jumped jumping tokens merges pieces").split()
lines = []
for _ in range(3000):
    n = random.randint(3, 14)
    ws = [random.choice(WORDS) for _ in range(n)]
    if random.random() < 0.3:
        ws.insert(random.randint(0, n), str(random.randint(0, 9999)))
    if random.random() < 0.2:
        ws[0] = ws[0].capitalize()
    line = " ".join(ws) + random.choice([".", ",", "!", "?", ""])
    if random.random() < 0.1:
        line = "  " + line
    lines.append(line)
lines += ["Café naïve façade", "über größe", "smile :) ;)", "a\tb\tc"] * 20

TEXTS = [
    "the quick brown fox",
    "Hello world, hello tokens!",
    "tokenizer merges pieces 2024",
    "  two leading spaces",
    "trailing space ",
    "multiple   spaces   here",
    "line one\nline two\n\nend",
    "tab\tseparated",
    "Café über",
    "unseen: 日本語 and 🙂",
    "<b>bold</b> text",
    "",
    " ",
    "zzzzqqqq xyzzy",
]


def train(prefix_dir, add_dummy_prefix):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=700,
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False,
        split_digits=True,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        control_symbols=["<start_of_turn>", "<end_of_turn>"],
        user_defined_symbols=["<b>", "</b>"],
        character_coverage=1.0,
        minloglevel=2,
    )
    path = os.path.join(HERE, prefix_dir, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=path)
    cases = []
    for i, t in enumerate(TEXTS):
        ids = sp.encode(t)
        cases.append({"name": f"case_{i}", "text": t, "ids": ids, "decoded": sp.decode(ids)})
    with open(os.path.join(HERE, prefix_dir, "cases.json"), "w") as f:
        json.dump({"about": "ids from the sentencepiece library on tokenizer.model", "cases": cases},
                  f, ensure_ascii=False, indent=1)
    return sp


def build_hf(sp):
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    vocab = {p: i for i, p in enumerate(pieces)}
    # Merges rebuilt from the vocabulary: every split of a normal piece into
    # two pieces, best score first.
    merges = []
    for i in range(n):
        if not sp.is_control(i) and not sp.is_byte(i) and not sp.is_unknown(i):
            p = pieces[i]
            for k in range(1, len(p)):
                a, b = p[:k], p[k:]
                if a in vocab and b in vocab:
                    merges.append((-sp.get_score(i), vocab[a], vocab[b], a, b))
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                     unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [AddedToken(pieces[i], special=True, normalized=False) for i in range(n) if sp.is_control(i)]
    tok.add_special_tokens(special)
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in ("<b>", "</b>", "\n", "\n\n")
                    if p in vocab])
    out = os.path.join(HERE, "tiny_hf")
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": {"content": "<eos>"}, "add_bos_token": True,
                   "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"},
                  f, indent=1)
    cases = []
    for i, t in enumerate(TEXTS + ["<start_of_turn>user\nhi<end_of_turn>"]):
        enc = tok.encode(t, add_special_tokens=False)
        cases.append({"name": f"case_{i}", "text": t, "ids": enc.ids,
                      "decoded": tok.decode(enc.ids, skip_special_tokens=False)})
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump({"about": "ids from the tokenizers library on tokenizer.json", "cases": cases},
                  f, ensure_ascii=False, indent=1)


sp = train("tiny_spm", add_dummy_prefix=False)
train("tiny_spm_prefix", add_dummy_prefix=True)
build_hf(sp)
