#!/usr/bin/env python3
"""A from-scratch numpy (float64) forward pass of a Gemma 3n text model, written from the "Gemma 3n semantics" section
of tests/data/gemma3n/README.md, with no transformers. It is a readable specification and a check: it must reproduce
the transformers reference (logits_*weights.bin, hidden_states_f32weights.bin) to float noise.

Usage: python numpy_reference.py MODEL_DIR REF_DIR          (needs numpy only)
  e.g. numpy_reference.py tests/data/gemma3n/tiny-gemma3n-f32 tests/data/gemma3n/tiny-gemma3n-ref
"""
import json, math, os, sys
import numpy as np


def load_safetensors(path):
    """Minimal safetensors reader (F32 / F16 / BF16) -> dict of float64 arrays."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw, dt = data[a:b], info["dtype"]
        if dt == "F32":
            arr = np.frombuffer(raw, "<f4")
        elif dt == "F16":
            arr = np.frombuffer(raw, "<f2")
        elif dt == "BF16":
            arr = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view("<f4")
        else:
            raise ValueError(dt)
        out[name] = arr.astype(np.float64).reshape(info["shape"])
    return out


def rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y               # Gemma 3n: times w itself (no 1 + w); v_norm has no w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def rope(x, theta):
    """x [T, heads, hd]; NeoX pairs (i, i + hd/2), inv_freq_i = theta^(-2i/hd), position = index."""
    T, hd = x.shape[0], x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(T)[:, None] * inv[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def norm_ppf(p):
    """Standard normal quantile (inverse CDF), by bisection on erf: exact to ~1e-15."""
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * (1.0 + math.erf(mid / math.sqrt(2.0))) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def magnitude(x):
    """RMS over the last axis, with the mean square clamped below at 1e-5 (used to rescale AltUp projections)."""
    return np.sqrt(np.maximum(np.mean(x * x, -1, keepdims=True), 1e-5))


def forward(model_dir, ids):
    c = json.load(open(os.path.join(model_dir, "config.json")))
    W = load_safetensors(os.path.join(model_dir, "model.safetensors"))
    H, L, nh, nkv, hd = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    P, Vp, eps, n = c["hidden_size_per_layer_input"], c["vocab_size_per_layer_input"], c["rms_norm_eps"], c["altup_num_inputs"]
    act, types, win = c["altup_active_idx"], c["layer_types"], c["sliding_window"]
    theta = {t: c["rope_parameters"][t]["rope_theta"] for t in ("sliding_attention", "full_attention")}
    ffw = c["intermediate_size"] if isinstance(c["intermediate_size"], list) else [c["intermediate_size"]] * L
    sparsity = c["activation_sparsity_pattern"]
    shared = c["num_kv_shared_layers"]
    cap = c.get("final_logit_softcapping")
    g = lambda k: W["model." + k]
    ids = np.asarray(ids)
    T = len(ids)

    # KV sharing: layers >= L - shared reuse the K/V of the last earlier layer of the same type
    first_shared = L - shared
    producer = {}
    for i in range(first_shared, L):
        producer[i] = max(j for j in range(first_shared) if types[j] == types[i])

    # embeddings and per-layer inputs
    x0 = g("embed_tokens.weight")[ids] * np.float64(np.float32(math.sqrt(H)))
    pid = np.where(ids < Vp, ids, 0)
    tok = (g("embed_tokens_per_layer.weight")[pid] * np.float64(np.float32(math.sqrt(P)))).reshape(T, L, P)
    proj = (x0 @ g("per_layer_model_projection.weight").T * H ** -0.5).reshape(T, L, P)
    proj = rms(proj, g("per_layer_projection_norm.weight"), eps)
    ple = (proj + tok) * 2 ** -0.5                                     # [T, L, P]

    # AltUp: n streams; 0 = x0, k = altup_projections[k-1](x0) rescaled to x0's RMS
    mag0 = np.sqrt(np.mean(x0 * x0, -1, keepdims=True))                 # target RMS: no clamp
    xs = [x0] + [(x0 @ g(f"altup_projections.{k - 1}.weight").T) for k in range(1, n)]
    xs = np.stack([xs[0]] + [y * mag0 / magnitude(y) for y in xs[1:]])   # [n, T, H]
    streams = [xs.copy()]

    kv = {}
    for l in range(L):
        p = f"layers.{l}."
        a = lambda k: g(p + k)

        def modalities(v):
            return np.tanh(rms(v, a("altup.router_norm.weight"), eps) * (1.0 / H) @ a("altup.modality_router.weight").T)

        # AltUp predict
        m = modalities(xs[act])                                                    # [T, n]
        C = (m @ a("altup.prediction_coefs.weight").T).reshape(T, n, n)            # C[t, j, k]
        pred = xs + np.einsum("tjk,ktd->jtd", C, xs)                               # pred_j = x_j + sum_k C[j,k] x_k
        active = pred[act]

        h = rms(active, a("input_layernorm.weight"), eps)
        laurel = h + rms(h @ a("laurel.linear_left.weight").T @ a("laurel.linear_right.weight").T,
                         a("laurel.post_laurel_norm.weight"), eps)

        # attention (scale 1.0, q/k norm with weights, v norm without)
        q = rms((h @ a("self_attn.q_proj.weight").T).reshape(T, nh, hd), a("self_attn.q_norm.weight"), eps)
        q = rope(q, theta[types[l]])
        if l in producer:
            k, v = kv[producer[l]]
        else:
            k = rms((h @ a("self_attn.k_proj.weight").T).reshape(T, nkv, hd), a("self_attn.k_norm.weight"), eps)
            k = rope(k, theta[types[l]])
            v = rms((h @ a("self_attn.v_proj.weight").T).reshape(T, nkv, hd), None, eps)
            kv[l] = (k, v)
        qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
        allowed = ki <= qi
        if types[l] == "sliding_attention":
            allowed = allowed & (qi - ki < win)
        o = np.zeros((T, nh, hd))
        for hh in range(nh):
            kh = hh // (nh // nkv)
            s = q[:, hh] @ k[:, kh].T
            s = np.where(allowed, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kh]
        attn = rms(o.reshape(T, nh * hd) @ a("self_attn.o_proj.weight").T, a("post_attention_layernorm.weight"), eps)

        x = (active + attn + laurel) * 2 ** -0.5

        # MLP with the Gaussian top-k on the gate pre-activation
        hm = rms(x, a("pre_feedforward_layernorm.weight"), eps)
        gate = hm @ a("mlp.gate_proj.weight").T
        if sparsity[l] > 0:
            mu = gate.mean(-1, keepdims=True)
            sd = np.sqrt(((gate - mu) ** 2).mean(-1, keepdims=True))          # population variance (divide by n)
            gate = np.maximum(gate - (mu + sd * np.float64(np.float32(norm_ppf(sparsity[l])))), 0.0)
        mlp = (gelu_tanh(gate) * (hm @ a("mlp.up_proj.weight").T)) @ a("mlp.down_proj.weight").T
        x = x + rms(mlp, a("post_feedforward_layernorm.weight"), eps)

        # AltUp correct
        m = modalities(x)
        coef = m @ a("altup.correction_coefs.weight").T + 1.0                     # [T, n]
        xs = pred + coef.T[:, :, None] * (x - active)[None]

        # per-layer input, added to every stream but the active one
        y = gelu_tanh((xs[act] * a("altup.correct_output_scale")) @ a("per_layer_input_gate.weight").T) * ple[:, l]
        y = rms(y @ a("per_layer_projection.weight").T, a("post_per_layer_input_norm.weight"), eps)
        for j in range(n):
            if j != 0:                       # transformers adds to streams 1.. (index 0, whatever altup_active_idx)
                xs[j] = xs[j] + y
        streams.append(xs.copy())

    # merge: streams 1.. unembedded and rescaled to stream 0's RMS, then the mean of all n
    mag0 = np.sqrt(np.mean(xs[0] * xs[0], -1, keepdims=True))
    outs = [xs[0]] + [xs[k] @ g(f"altup_unembed_projections.{k - 1}.weight").T for k in range(1, n)]
    outs = [outs[0]] + [y * mag0 / magnitude(y) for y in outs[1:]]
    final = rms(np.mean(outs, 0), g("norm.weight"), eps)
    logits = final @ g("embed_tokens.weight").T
    if cap:
        logits = cap * np.tanh(logits / cap)
    return logits, np.stack(streams), final, ple


def main():
    mdir, rdir = sys.argv[1], sys.argv[2]
    ref = json.load(open(os.path.join(rdir, "reference.json")))
    ids = ref["input_ids"]
    logits, hs, final, ple = forward(mdir, ids)
    tag = "bf16" if "bf16" in os.path.basename(mdir.rstrip("/")) else "f32"
    rl = np.fromfile(os.path.join(rdir, f"logits_{tag}weights.bin"), "<f4").reshape(logits.shape)
    print("logits max abs diff", float(np.abs(logits - rl).max()))
    if tag == "f32":
        rh = np.fromfile(os.path.join(rdir, "hidden_states_f32weights.bin"), "<f4").reshape(hs.shape)
        print("hidden states max abs diff per index", [float(f"{v:.2e}") for v in np.abs(hs - rh).reshape(len(hs), -1).max(1)])
        rp = np.fromfile(os.path.join(rdir, "per_layer_inputs_f32weights.bin"), "<f4").reshape(ple.shape)
        print("per-layer inputs max abs diff", float(np.abs(ple - rp).max()))


if __name__ == "__main__":
    main()
