#!/usr/bin/env python3
"""Make small random Gemma models with awkward shapes, plus their expected logits.

Each fixture is a Hugging Face style folder (``config.json`` and
``model.safetensors``) together with the logits of a fixed token sequence at
every position, computed here by an independent float64 implementation of the
Gemma forward pass. That implementation works on the whole sequence at once,
in matrix form, with an explicit causal / sliding-window mask; it shares no
structure with Pulsar's one-token-at-a-time, KV-cached reference engine.

Output, per fixture, under ``tests/data/fixtures/<name>/``:

* ``config.json``        HF config (transformers 4 or 5 key style)
* ``model.safetensors``  weights, written by the small writer below
* ``expected.json``      input ids, logits shape and notes
* ``logits.bin``         raw little-endian float32 logits ``[tokens, vocab]``

Regenerate (numpy is the only dependency; use a throwaway virtualenv)::

    python3 -m venv /tmp/fixvenv && /tmp/fixvenv/bin/pip install numpy
    /tmp/fixvenv/bin/python tools/make_fixtures.py

The output is deterministic (fixed seeds), so rerunning it must leave the
committed files unchanged.
"""

import json
import math
import struct
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "fixtures"


# ---------------------------------------------------------------------------
# Storage helpers


def bf16_round(x):
    """Rounds float values to bfloat16 (nearest, ties to even).

    Returns (the uint16 bit patterns, the rounded values as float64)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    patterns = rounded.astype(np.uint16)
    values = (patterns.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return patterns, values


def write_safetensors(path, tensors):
    """Writes ``{name: (dtype_name, shape, raw_bytes)}`` as a safetensors file.

    Layout: u64 LE header length, JSON header (padded with spaces to a
    multiple of 8), then the tensors' bytes back to back in name order."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


# ---------------------------------------------------------------------------
# The float64 Gemma forward pass, whole sequence at once


def rms_norm(x, w, eps):
    """HF Gemma RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def rotate(x, positions, base):
    """Split-half RoPE on ``x[..., seq, heads, dim]``: element i pairs with i + dim/2."""
    dim = x.shape[-1]
    half = dim // 2
    inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]
    cos = np.cos(angle)[:, None, :]
    sin = np.sin(angle)[:, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def attention_mask(n, window):
    """mask[q, k] is True where query q may attend to key k: k <= q, and
    q - window < k when the layer slides."""
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def forward(spec, w, ids, drop=()):
    """Logits ``[len(ids), vocab]`` in float64.

    ``drop`` names features to switch off, only for the sensitivity notes
    ("final_softcap", "attn_softcap", "window", "query_scalar")."""
    fam = spec["family"]
    eps = spec["rms_eps"]
    n = len(ids)
    hd = spec["head_dim"]
    heads, kv_heads = spec["heads"], spec["kv_heads"]
    group = heads // kv_heads
    pos = np.arange(n)
    scalar = spec["query_pre_attn_scalar"] if fam != "gemma" else hd
    if "query_scalar" in drop:
        scalar = hd
    scale = 1.0 / math.sqrt(scalar)

    x = w["model.embed_tokens.weight"][ids] * math.sqrt(spec["hidden"])
    for i, kind in enumerate(spec["layer_kinds"]):
        p = f"model.layers.{i}."
        window = spec["window"] if kind == "sliding" and "window" not in drop else None
        base = spec["rope_local"] if kind == "sliding" else spec["rope_global"]

        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv_heads, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv_heads, hd)
        if fam == "gemma3_text":
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = rotate(q, pos, base) * scale
        k = rotate(k, pos, base)
        # Query head j reads KV head j // group.
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k)
        cap = spec.get("attn_softcap")
        if cap and "attn_softcap" not in drop:
            scores = cap * np.tanh(scores / cap)
        scores = np.where(attention_mask(n, window)[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        mixed = np.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * hd)
        out = mixed @ w[p + "self_attn.o_proj.weight"].T
        if fam == "gemma":
            x = x + out
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        else:
            x = x + rms_norm(out, w[p + "post_attention_layernorm.weight"], eps)
            h = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        gate = gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T)
        up = h @ w[p + "mlp.up_proj.weight"].T
        out = (gate * up) @ w[p + "mlp.down_proj.weight"].T
        if fam != "gemma":
            out = rms_norm(out, w[p + "post_feedforward_layernorm.weight"], eps)
        x = x + out
    x = rms_norm(x, w["model.norm.weight"], eps)
    logits = x @ w["model.embed_tokens.weight"].T
    cap = spec.get("final_softcap")
    if cap and "final_softcap" not in drop:
        logits = cap * np.tanh(logits / cap)
    return logits


# ---------------------------------------------------------------------------
# Random weights and configs


def tensor_shapes(spec):
    """Every HF tensor name with its ``[out, in]`` shape."""
    hid, inter, hd = spec["hidden"], spec["intermediate"], spec["head_dim"]
    qd, kvd = spec["heads"] * hd, spec["kv_heads"] * hd
    shapes = {"model.embed_tokens.weight": (spec["vocab"], hid), "model.norm.weight": (hid,)}
    for i in range(len(spec["layer_kinds"])):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hid,),
                p + "post_attention_layernorm.weight": (hid,),
                p + "self_attn.q_proj.weight": (qd, hid),
                p + "self_attn.k_proj.weight": (kvd, hid),
                p + "self_attn.v_proj.weight": (kvd, hid),
                p + "self_attn.o_proj.weight": (hid, qd),
                p + "mlp.gate_proj.weight": (inter, hid),
                p + "mlp.up_proj.weight": (inter, hid),
                p + "mlp.down_proj.weight": (hid, inter),
            }
        )
        if spec["family"] != "gemma":
            shapes[p + "pre_feedforward_layernorm.weight"] = (hid,)
            shapes[p + "post_feedforward_layernorm.weight"] = (hid,)
        if spec["family"] == "gemma3_text":
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def random_weights(spec):
    """Norm weights uniform in [-0.5, 0.5] (so the (1 + w) convention
    matters); matrices normal with per-role standard deviations."""
    rng = np.random.default_rng(spec["seed"])
    stds = spec["stds"]
    weights = {}
    for name, shape in tensor_shapes(spec).items():
        if len(shape) == 1:
            values = rng.uniform(-0.5, 0.5, size=shape)
        else:
            role = name.split(".")[-2]
            values = rng.normal(0.0, stds.get(role, stds["default"]), size=shape)
        weights[name] = values
    return weights


def hf_config(spec):
    """config.json in the key style the spec asks for."""
    fam = spec["family"]
    arch = {
        "gemma": "GemmaForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
    }[fam]
    layer_types = [
        "sliding_attention" if k == "sliding" else "full_attention" for k in spec["layer_kinds"]
    ]
    cfg = {
        "architectures": [arch],
        "model_type": fam,
        "vocab_size": spec["vocab"],
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"],
        "num_hidden_layers": len(spec["layer_kinds"]),
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"],
        "rms_norm_eps": spec["rms_eps"],
        "max_position_embeddings": 256,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "dtype": spec["dtype"],
    }
    if fam != "gemma":
        cfg["query_pre_attn_scalar"] = spec["query_pre_attn_scalar"]
        cfg["sliding_window"] = spec["window"]
        cfg["attn_logit_softcapping"] = spec.get("attn_softcap")
        cfg["final_logit_softcapping"] = spec.get("final_softcap")
    if spec["style"] == 5:
        cfg["transformers_version"] = "5.0.0"
        cfg["hidden_act"] = "gelu_pytorch_tanh"
        if fam != "gemma":
            cfg["layer_types"] = layer_types
        if fam == "gemma3_text":
            cfg["rope_parameters"] = {
                "full_attention": {"rope_type": "default", "rope_theta": spec["rope_global"]},
                "sliding_attention": {"rope_type": "default", "rope_theta": spec["rope_local"]},
            }
        else:
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": spec["rope_global"]}
    else:
        cfg["transformers_version"] = "4.50.0"
        # Like gemma-2b's config: plain "gelu", meaning the tanh form.
        cfg["hidden_act"] = "gelu"
        cfg["hidden_activation"] = "gelu_pytorch_tanh" if fam != "gemma" else None
        cfg["rope_theta"] = spec["rope_global"]
        cfg["rope_scaling"] = None
        if fam == "gemma3_text":
            cfg["rope_local_base_freq"] = spec["rope_local"]
            cfg["sliding_window_pattern"] = spec["sliding_window_pattern"]
    return cfg


SPECS = [
    {
        # Odd sizes everywhere, 6 query heads over 2 KV heads, a query scalar
        # that is not head_dim, window 3 over 13 tokens, layers
        # sliding / global / sliding from sliding_window_pattern 2.
        "name": "awkward-gemma3",
        "family": "gemma3_text",
        "style": 4,
        "dtype": "float32",
        "seed": 3,
        "vocab": 97,
        "hidden": 46,
        "intermediate": 58,
        "heads": 6,
        "kv_heads": 2,
        "head_dim": 18,
        "query_pre_attn_scalar": 17,
        "window": 3,
        "sliding_window_pattern": 2,
        "layer_kinds": ["sliding", "global", "sliding"],
        "rope_global": 1_000_000.0,
        "rope_local": 10_000.0,
        "rms_eps": 1e-6,
        "stds": {"embed_tokens": 0.3, "default": 0.15},
        "ids": [2, 96, 0, 41, 7, 7, 88, 13, 55, 3, 70, 29, 64],
    },
    {
        # Softcaps small enough to bind, 4 query heads over a single KV head,
        # odd hidden and intermediate sizes, window 4 over 14 tokens.
        # query_pre_attn_scalar = head_dim so that a GGUF copy (which cannot
        # carry the scalar) describes the same model.
        "name": "awkward-gemma2",
        "family": "gemma2",
        "style": 5,
        "dtype": "float32",
        "seed": 2,
        "vocab": 89,
        "hidden": 39,
        "intermediate": 77,
        "heads": 4,
        "kv_heads": 1,
        "head_dim": 14,
        "query_pre_attn_scalar": 14,
        "window": 4,
        "layer_kinds": ["sliding", "global", "sliding", "global"],
        "rope_global": 10_000.0,
        "rope_local": 10_000.0,
        "rms_eps": 1e-6,
        "attn_softcap": 5.0,
        "final_softcap": 3.0,
        "stds": {"embed_tokens": 0.35, "q_proj": 0.4, "k_proj": 0.4, "default": 0.2},
        "ids": [2, 88, 5, 17, 0, 61, 61, 33, 8, 72, 40, 19, 51, 26],
    },
    {
        # Full multi-head attention (5 heads, 5 KV heads) with head_dim 10,
        # weights stored as bfloat16; the oracle uses the rounded values.
        "name": "awkward-gemma1",
        "family": "gemma",
        "style": 4,
        "dtype": "bfloat16",
        "seed": 1,
        "vocab": 101,
        "hidden": 40,
        "intermediate": 90,
        "heads": 5,
        "kv_heads": 5,
        "head_dim": 10,
        "layer_kinds": ["global", "global", "global"],
        "rope_global": 10_000.0,
        "rope_local": 10_000.0,
        "rms_eps": 1e-6,
        "stds": {"embed_tokens": 0.3, "default": 0.15},
        "ids": [2, 100, 37, 4, 4, 91, 0, 58, 23, 77, 12],
    },
]


def build(spec):
    weights = random_weights(spec)
    tensors = {}
    for name, values in weights.items():
        if spec["dtype"] == "bfloat16":
            patterns, rounded = bf16_round(values)
            tensors[name] = ("BF16", values.shape, patterns.astype("<u2").tobytes())
        else:
            stored = values.astype(np.float32)
            rounded = stored.astype(np.float64)
            tensors[name] = ("F32", values.shape, stored.astype("<f4").tobytes())
        # The oracle computes with exactly the stored values.
        weights[name] = rounded

    ids = np.array(spec["ids"])
    assert ids.max() < spec["vocab"]
    logits = forward(spec, weights, ids)

    notes = {}
    for feature in ("final_softcap", "attn_softcap", "window", "query_scalar"):
        applies = {
            "final_softcap": spec.get("final_softcap"),
            "attn_softcap": spec.get("attn_softcap"),
            "window": "sliding" in spec["layer_kinds"],
            "query_scalar": spec["family"] != "gemma"
            and spec["query_pre_attn_scalar"] != spec["head_dim"],
        }[feature]
        if applies:
            moved = np.abs(forward(spec, weights, ids, drop=(feature,)) - logits).max()
            notes[f"max_logit_change_without_{feature}"] = float(moved)

    folder = OUT / spec["name"]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "config.json", "w") as f:
        json.dump(hf_config(spec), f, indent=2)
        f.write("\n")
    write_safetensors(folder / "model.safetensors", tensors)
    logits.astype("<f4").tofile(folder / "logits.bin")
    expected = {
        "input_ids": [int(i) for i in ids],
        "logits_shape": list(logits.shape),
        "logits_file": "logits.bin",
        "logits_dtype": "float32 little-endian, row-major [tokens, vocab]",
        "oracle": "tools/make_fixtures.py, float64 numpy, whole sequence with a mask matrix",
        "max_abs_logit": float(np.abs(logits).max()),
        "sensitivity": notes,
    }
    with open(folder / "expected.json", "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{spec['name']}: {size} bytes, max |logit| {expected['max_abs_logit']:.3f}, {notes}")
    assert size < 300_000, "fixture folder too large"


def main():
    for spec in SPECS:
        build(spec)


if __name__ == "__main__":
    main()
