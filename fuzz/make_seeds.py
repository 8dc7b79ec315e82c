#!/usr/bin/env python3
"""Writes small seed corpora to fuzz/corpus/<target>/ (not committed).

Seeds are a few kilobytes at most: a tiny but complete Gemma GGUF, the
first 4 KiB of the default model, hand-made safetensors files, the configs
of the test fixtures, and some tokenizer inputs."""

import json
import os
import struct
import sys
from pathlib import Path

FUZZ = Path(__file__).resolve().parent
ROOT = FUZZ.parent
ORACLE = ROOT.parent / "shared" / "oracle"
CORPUS = FUZZ / "corpus"


def put(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def tiny_gguf(arch, layers, with_vocab):
    """A complete model: hidden 4, one head of 4, ffn 4, vocab 4, F32."""
    hidden, ffn, vocab = 4, 4, 4
    kv = [
        ("general.architecture", 8, gguf_str(arch)),
        (f"{arch}.block_count", 4, struct.pack("<I", layers)),
        (f"{arch}.embedding_length", 4, struct.pack("<I", hidden)),
        (f"{arch}.feed_forward_length", 4, struct.pack("<I", ffn)),
        (f"{arch}.attention.head_count", 4, struct.pack("<I", 1)),
        (f"{arch}.context_length", 4, struct.pack("<I", 16)),
    ]
    if with_vocab:
        pieces = ["<pad>", "<eos>", "<bos>", "\u2581a"]
        arr = struct.pack("<IQ", 8, len(pieces)) + b"".join(gguf_str(p) for p in pieces)
        kv.append(("tokenizer.ggml.tokens", 9, arr))
        kv.append(("tokenizer.ggml.scores", 9,
                   struct.pack("<IQ", 6, 4) + struct.pack("<4f", 0, 0, 0, -1)))
        kv.append(("tokenizer.ggml.token_type", 9,
                   struct.pack("<IQ", 5, 4) + struct.pack("<4i", 3, 3, 3, 1)))
    tensors = [("token_embd.weight", [hidden, vocab]), ("output_norm.weight", [hidden])]
    for i in range(layers):
        for n in ["attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"]:
            tensors.append((f"blk.{i}.{n}.weight", [hidden]))
        for n in ["attn_q_norm", "attn_k_norm"]:
            tensors.append((f"blk.{i}.{n}.weight", [4]))
        for n in ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]:
            tensors.append((f"blk.{i}.{n}.weight", [4, 4]))
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, t, payload in kv:
        out += gguf_str(k) + struct.pack("<I", t) + payload
    data = b""
    for name, dims in tensors:
        n = 1
        for d in dims:
            n *= d
        out += gguf_str(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", 0, len(data))
        data += struct.pack(f"<{n}f", *[0.25 * (k % 5) for k in range(n)])
        data += b"\0" * ((-len(data)) % 32)
    out += b"\0" * ((-len(out)) % 32)
    return out + data


def safetensors(entries):
    header, data = {}, b""
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def main():
    put("gguf", "tiny-gemma3", tiny_gguf("gemma3", 1, True))
    put("gguf", "tiny-gemma", tiny_gguf("gemma", 1, False))
    model = os.environ.get("PULSAR_MODEL") or str(
        Path.home() / ".cache" / "pulsar" / "gemma-3-270m-q4_k_m.gguf")
    if Path(model).is_file():
        with open(model, "rb") as f:
            put("gguf", "default-model-head", f.read(4096))
    else:
        print(f"note: {model} not found; no seed from the real model", file=sys.stderr)

    put("safetensors", "two", safetensors([
        ("a", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
        ("b", "BF16", [3], b"\x80\x3f" * 3),
        ("c", "F16", [1, 1], b"\x00\x3c"),
    ]))
    put("safetensors", "meta", safetensors([]).replace(b"{}", b'{"__metadata__":{"format":"pt"}}', 1)
        .replace(struct.pack("<Q", 2), struct.pack("<Q", 32), 1))
    st = ORACLE / "tiny-gemma1-f32" / "model.safetensors"
    if st.is_file():
        with open(st, "rb") as f:
            put("safetensors", "tiny-gemma1-head", f.read(4096))

    for cfg in sorted(list(ORACLE.glob("*/config.json")) +
                      list((ROOT / "tests" / "data" / "fixtures").glob("*/config.json"))):
        put("hf_config", cfg.parent.name, cfg.read_bytes())

    # hf_tokenizer: first byte 0 = tokenizer.json, 1 = tokenizer.model.
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<0x0A>": 4, "<0xC3>": 5,
             "\u2581": 6, "a": 7, "b": 8, "ab": 9, "\u2581ab": 10}
    tj = {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
          "pre_tokenizer": None,
          "model": {"type": "BPE", "byte_fallback": True, "vocab": vocab,
                    "merges": ["a b", ["\u2581", "ab"]]},
          "added_tokens": [{"id": 1, "content": "<eos>", "special": True},
                           {"id": 11, "content": "<start_of_turn>", "special": True},
                           {"id": 12, "content": "\n\n", "special": False}]}
    put("hf_tokenizer", "tokenizer-json", b"\x00" + json.dumps(tj).encode())

    def varint(n):
        out = b""
        while True:
            b = n & 0x7F
            n >>= 7
            if n:
                out += bytes([b | 0x80])
            else:
                return out + bytes([b])

    def field(num, payload):
        return varint(num << 3 | 2) + varint(len(payload)) + payload

    def vfield(num, v):
        return varint(num << 3) + varint(v & 0xFFFFFFFFFFFFFFFF)

    pieces = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<0x41>", 6), ("\u2581a", 1), ("b", 1)]
    spm = b""
    for i, (text, kind) in enumerate(pieces):
        spm += field(1, field(1, text.encode()) + struct.pack("<B", 2 << 3 | 5)
                     + struct.pack("<f", -float(i)) + vfield(3, kind))
    spm += field(2, vfield(3, 2) + vfield(40, 0) + vfield(41, 1) + vfield(42, 2) + vfield(43, -1))
    spm += field(3, field(1, b"identity") + vfield(3, 1) + vfield(4, 0))
    put("hf_tokenizer", "tokenizer-model", b"\x01" + spm)

    texts = ["The capital of France is", "<start_of_turn>user\nhi<end_of_turn>\n",
             "  two  spaces\n\n\ttab", "caf\u00e9 \u65e5\u672c\u8a9e \U0001F600", "<bos><eos><pad>"]
    for i, t in enumerate(texts):
        put("tokenizer", f"text-{i}", b"\x00" + t.encode())
        put("tokenizer", f"text-bos-{i}", b"\x02" + t.encode())
    put("tokenizer", "ids", b"\x01" + b"".join(struct.pack("<I", i)
                                                for i in [2, 818, 5279, 529, 7001, 563, 106, 1, 238, 200000]))


main()
