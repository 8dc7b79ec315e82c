#!/usr/bin/env python3
"""Independent float64 numpy forward of the tiny Gemma 4 target and its assistant (drafter), written from the spec
in tests/data/gemma4-assistant/README.md. Imports no transformers and no torch.

Usage: python numpy_reference.py [FIXTURES] [--bugs]        (default tests/data/gemma4-assistant)
For every case in tiny-g4a-ref/reference.json it runs the target over ids[:n-1], drafts K tokens with the centroid
head and with the full head (f32 and bf16 assistant folders), checks that the drafted tokens equal the reference's,
and prints the max abs difference of every reference tensor. Exits non-zero if a token differs or a logit differs
by more than 1e-4. --bugs prints instead how far the drafts move when one thing is done wrong.
"""
import json, math, os, struct, sys
import numpy as np

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
ROOT = ARGS[0] if ARGS else "tests/data/gemma4-assistant"
S, F = "sliding_attention", "full_attention"
BUG = set()   # deliberate mistakes for the sensitivity table (--bugs); empty = the spec


# ----------------------------------------------------------------------------------------------- loading
def read_safetensors(path):
    """{name: float64 array} (int64 stays int64); handles F32, BF16, I64 without torch."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        blob = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = blob[a:b]
        if meta["dtype"] == "F32":
            arr = np.frombuffer(raw, "<f4").astype(np.float64)
        elif meta["dtype"] == "BF16":
            arr = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        elif meta["dtype"] == "I64":
            arr = np.frombuffer(raw, "<i8").copy()
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {meta['dtype']}, not handled")
        out[name] = arr.reshape(meta["shape"])
    return out


def load(folder):
    cfg = json.load(open(os.path.join(folder, "config.json")))
    return cfg, read_safetensors(os.path.join(folder, "model.safetensors"))


# ----------------------------------------------------------------------------------------------- pieces
def rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def arms(x, w, eps):
    """An assistant norm (the place where the norm_one_plus_w mistake is tried)."""
    return rms(x, w + 1.0 if "norm_one_plus_w" in BUG else w, eps)


def gelu(x):
    if "gelu_erf" in BUG:
        return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def inv_freq(tc, layer_type, hd):
    """NeoX RoPE frequencies over head width hd; proportional RoPE rotates only the first int(p*hd//2) pairs, with
    exponents over the whole hd, and leaves the rest (frequency 0)."""
    rp = tc["rope_parameters"][layer_type]
    f = rp["rope_theta"] ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    if rp.get("rope_type") == "proportional" and "full_rope_all_pairs" not in BUG:
        f[int(rp["partial_rotary_factor"] * hd // 2):] = 0.0
    return f


def rope(x, pos, freqs):
    """x [..., T, hd] at positions pos [T]: pairs (i, i + hd/2)."""
    ang = np.asarray(pos, dtype=np.float64)[:, None] * freqs[None, :]
    c, s = np.cos(ang), np.sin(ang)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def layer_dims(tc, i):
    plc = tc.get("per_layer_config") or {}
    over = plc.get(str(i), {})
    return over.get("head_dim", tc["head_dim"]), over.get("num_key_value_heads", tc["num_key_value_heads"])


def attend(q, k, v, allowed):
    """q [H, Tq, d], k/v [KV, Tk, d], allowed [Tq, Tk] bool; scale 1.0; GQA by head // (H / KV)."""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = q @ k.transpose(0, 2, 1)
    if "attn_scale_inv_sqrt_hd" in BUG:
        s = s / math.sqrt(q.shape[-1])
    s = np.where(allowed[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return s @ v


def mlp(w, p, x):
    return (gelu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T


# ----------------------------------------------------------------------------------------------- target
def target_forward(cfg, w, ids):
    """Logits [T,V], final-norm hidden [T,H], and {layer_type: (K [kv,T,d], V [kv,T,d])} of the producer layers
    (the last non-shared layer of each type)."""
    tc, eps = cfg, cfg["rms_norm_eps"]
    H, L, P, T = tc["hidden_size"], tc["num_hidden_layers"], tc["hidden_size_per_layer_input"], len(ids)
    types, W = tc["layer_types"], tc["sliding_window"]
    first_shared = L - tc["num_kv_shared_layers"]
    producer = {t: max(i for i in range(first_shared) if types[i] == t) for t in set(types)}
    E = w["model.embed_tokens.weight"]
    x = E[ids] * math.sqrt(H)
    ple = None
    if P:
        tok = w["model.embed_tokens_per_layer.weight"][ids].reshape(T, L, P) * math.sqrt(P)
        proj = (x @ w["model.per_layer_model_projection.weight"].T * H ** -0.5).reshape(T, L, P)
        ple = (rms(proj, w["model.per_layer_projection_norm.weight"], eps) + tok) * 2 ** -0.5
    pos = np.arange(T)
    causal = pos[None, :] <= pos[:, None]
    window = causal & (pos[None, :] > pos[:, None] - W)
    kv = {}
    for i in range(L):
        p, lt = f"model.layers.{i}.", types[i]
        hd, nkv = layer_dims(tc, i)
        fr = inv_freq(tc, lt, hd)
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, -1, hd).transpose(1, 0, 2)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"], eps), pos, fr)
        if i < first_shared:
            kr = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
            vw = w.get(p + "self_attn.v_proj.weight")
            vr = kr if vw is None else (h @ vw.T).reshape(T, nkv, hd).transpose(1, 0, 2)
            k = rope(rms(kr, w[p + "self_attn.k_norm.weight"], eps), pos, fr)
            v = rms(vr, None, eps)
            kv[i] = (k, v)
        else:
            k, v = kv[producer[lt]]
        a = attend(q, k, v, window if lt == S else causal).transpose(1, 0, 2).reshape(T, -1)
        x = x + rms(a @ w[p + "self_attn.o_proj.weight"].T, w[p + "post_attention_layernorm.weight"], eps)
        m = mlp(w, p, rms(x, w[p + "pre_feedforward_layernorm.weight"], eps))
        x = x + rms(m, w[p + "post_feedforward_layernorm.weight"], eps)
        if P:
            g = gelu(x @ w[p + "per_layer_input_gate.weight"].T) * ple[:, i]
            x = x + rms(g @ w[p + "per_layer_projection.weight"].T, w[p + "post_per_layer_input_norm.weight"], eps)
        x = x * w[p + "layer_scalar"][0]
    hid = rms(x, w["model.norm.weight"], eps)
    target_forward.pre_norm, target_forward.all_kv = x, kv
    logits = hid @ E.T
    cap = tc.get("final_logit_softcapping")
    if cap:
        logits = cap * np.tanh(logits / cap)
    return logits, hid, {t: kv[producer[t]] for t in producer}


# ----------------------------------------------------------------------------------------------- drafter
def draft(acfg, aw, tcfg, tw, ids, k_drafts, head, sliding_keys=None):
    """sliding_keys: None = the last W+1 target positions (transformers); an int m = the last m (llama.cpp: W-1)."""
    tc, eps = acfg["text_config"], acfg["text_config"]["rms_norm_eps"]
    n = len(ids)
    t_logits, t_hid, kv = target_forward(tcfg, tw, ids[:n - 1])
    Ht, W, p = acfg["backbone_hidden_size"], tc["sliding_window"], n - 1
    Et, Ea = tw["model.embed_tokens.weight"], aw["model.embed_tokens.weight"]
    C, topk = acfg["num_centroids"], acfg["centroid_intermediate_top_k"]
    ordered = bool(acfg.get("use_ordered_embeddings"))
    if ordered:
        clusters = aw["masked_embedding.token_ordering"].reshape(C, -1)
    tok, h = ids[n - 1], t_hid[n - 2]
    if "h0_before_final_norm" in BUG:
        h = target_forward.pre_norm[n - 2]
    if "sliding_reads_target_layer_0" in BUG:
        kv = dict(kv, **{S: target_forward.all_kv[0]})
    if "position_n_minus_2" in BUG:
        p = n - 2
    h0 = h
    rec = {k: [] for k in ("tokens", "inputs", "pre_projection", "layers", "final_norm", "post_projection",
                           "centroid_logits", "full_logits", "logits")}
    for _ in range(k_drafts):
        e = Et[tok] * (1.0 if "embedding_unscaled" in BUG else math.sqrt(Ht))
        x = np.concatenate([h, e] if "concat_swapped" in BUG else [e, h])
        a = aw["pre_projection.weight"] @ x
        rec["inputs"].append(x)
        rec["pre_projection"].append(a)
        outs = []
        for i, lt in enumerate(tc["layer_types"]):
            pf = f"model.layers.{i}."
            hd, _ = layer_dims(tc, i)
            k, v = kv[lt]
            if lt == S:
                m = W + 1 if sliding_keys is None else sliding_keys
                m = {"sliding_last_W": W, "sliding_all_keys": k.shape[1]}.get(next(iter(BUG & {"sliding_last_W", "sliding_all_keys"}), ""), m)
                k, v = k[:, -m:], v[:, -m:]
            u = arms(a, aw[pf + "input_layernorm.weight"], eps)
            q = (aw[pf + "self_attn.q_proj.weight"] @ u).reshape(-1, 1, hd)
            q = rope(arms(q, aw[pf + "self_attn.q_norm.weight"], eps), [p], inv_freq(tc, lt, hd))
            o = attend(q, k, v, np.ones((1, k.shape[1]), bool)).reshape(-1)
            a = a + arms(aw[pf + "self_attn.o_proj.weight"] @ o, aw[pf + "post_attention_layernorm.weight"], eps)
            m = mlp(aw, pf, arms(a, aw[pf + "pre_feedforward_layernorm.weight"], eps))
            a = a + arms(m, aw[pf + "post_feedforward_layernorm.weight"], eps)
            if "layer_scalar_ignored" not in BUG:
                a = a * aw[pf + "layer_scalar"][0]
            outs.append(a)
        f = arms(a, aw["model.norm.weight"], eps)
        full = Ea @ f
        if "softcap_30" in BUG:
            full = 30.0 * np.tanh(full / 30.0)
        logits = full
        if ordered:
            s = aw["masked_embedding.centroids.weight"] @ f
            rec["centroid_logits"].append(s)
        if ordered and head == "centroid":
            keep = clusters[np.argsort(-s, kind="stable")[:topk + ("topk_plus_1" in BUG)]].reshape(-1)
            logits = np.full_like(full, full[keep].min() - 1.0)
            logits[keep] = full[keep]
        h = aw["post_projection.weight"] @ f
        if "h_not_fed_back" in BUG:
            h = h0
        if "position_advances" in BUG:
            p += 1
        rec["layers"].append(np.stack(outs))
        rec["final_norm"].append(f)
        rec["post_projection"].append(h)
        rec["full_logits"].append(full)
        rec["logits"].append(logits)
        tok = int(np.argmax(logits))
        rec["tokens"].append(tok)
    res = {k: (np.stack(v) if k != "tokens" else v) for k, v in rec.items() if v}
    res["target_logits"], res["target_final_hidden"] = t_logits, t_hid
    res["target_kv"] = kv
    return res


# ----------------------------------------------------------------------------------------------- check
def W_of(acfg):
    return acfg["text_config"]["sliding_window"]


BUGS = ["position_advances", "position_n_minus_2", "embedding_unscaled", "concat_swapped", "h0_before_final_norm",
        "h_not_fed_back", "norm_one_plus_w", "attn_scale_inv_sqrt_hd", "sliding_last_W", "sliding_all_keys",
        "sliding_reads_target_layer_0", "layer_scalar_ignored", "softcap_30", "full_rope_all_pairs", "gelu_erf",
        "topk_plus_1"]


def sensitivity():
    """Max abs change of the draft logits (case b, f32 folder) when one thing is done wrong, and whether the drafted
    tokens change. The W-1 window (llama.cpp's) is in the reference files already."""
    ref = os.path.join(ROOT, "tiny-g4a-ref")
    info = json.load(open(os.path.join(ref, "reference.json")))
    tcfg, tw = load(os.path.join(ROOT, "tiny-g4a-target-f32"))
    acfg, aw = load(os.path.join(ROOT, "tiny-g4a-assistant-f32"))
    ids, K, out = info["cases"]["b"]["ids"], info["K"], {}
    base = {h: draft(acfg, aw, tcfg, tw, ids, K, h) for h in ("centroid", "full")}
    for bug in BUGS:
        BUG.clear()
        BUG.add(bug)
        row = {}
        for h in ("centroid", "full"):
            if bug == "topk_plus_1" and h == "full":
                continue
            r = draft(acfg, aw, tcfg, tw, ids, K, h)
            row[h] = {"step0": float(np.abs(r["logits"][0] - base[h]["logits"][0]).max()),
                      "all_steps": float(np.abs(r["logits"] - base[h]["logits"]).max()),
                      "tokens_change": r["tokens"] != base[h]["tokens"]}
        out[bug] = row
        print(f"{bug:30s} " + "  ".join(f"{h}: step0 {v['step0']:.3g} all {v['all_steps']:.3g} tok {v['tokens_change']}"
                                        for h, v in row.items()))
    BUG.clear()
    return out


def main():
    if "--bugs" in sys.argv:
        print("RESULT " + json.dumps(sensitivity()))
        return
    ref = os.path.join(ROOT, "tiny-g4a-ref")
    info = json.load(open(os.path.join(ref, "reference.json")))
    tcfg, tw = load(os.path.join(ROOT, "tiny-g4a-target-f32"))
    K = info["K"]
    worst, ok, report = {}, True, {}

    def cmp(name, mine):
        nonlocal ok
        refv = np.fromfile(os.path.join(ref, name), "<f4").reshape(info["files"][name]["shape"])
        d = float(np.abs(mine - refv).max())
        report[name] = d
        if name.endswith("logits.bin") and d > 1e-4:
            ok = False
        return d

    for dt in ("f32", "bf16"):
        acfg, aw = load(os.path.join(ROOT, f"tiny-g4a-assistant-{dt}"))
        for cname, case in info["cases"].items():
            for head in ("centroid", "full"):
                r = draft(acfg, aw, tcfg, tw, case["ids"], K, head)
                if r["tokens"] != case[f"tokens_{head}_{dt}"]:
                    ok = False
                    print(f"TOKENS DIFFER {cname} {head} {dt}: {r['tokens']} vs {case[f'tokens_{head}_{dt}']}")
                cmp(f"{cname}_{head}_{dt}_logits.bin", r["logits"])
                win = f"{cname}_{head}_{dt}_window{W_of(acfg) - 1}_logits.bin"
                if win in info["files"]:
                    rw = draft(acfg, aw, tcfg, tw, case["ids"], K, head, sliding_keys=W_of(acfg) - 1)
                    ok &= rw["tokens"] == case[f"tokens_{head}_{dt}_window{W_of(acfg) - 1}"]
                    cmp(win, rw["logits"])
                if dt == "f32":
                    for key in ("inputs", "pre_projection", "layers", "final_norm", "post_projection",
                                "centroid_logits", "full_logits"):
                        cmp(f"{cname}_{head}_{dt}_{key}.bin", r[key])
                    if head == "centroid":
                        cmp(f"{cname}_target_logits.bin", r["target_logits"])
                        cmp(f"{cname}_target_final_hidden.bin", r["target_final_hidden"])
                        for lt, short in ((S, "sliding"), (F, "full")):
                            cmp(f"{cname}_target_kv_{short}_k.bin", r["target_kv"][lt][0])
                            cmp(f"{cname}_target_kv_{short}_v.bin", r["target_kv"][lt][1])
    for k in sorted(report):
        print(f"{k:45s} {report[k]:.3e}")
    logit_max = max(v for k, v in report.items() if k.endswith("_logits.bin") and "target" not in k)
    print(f"max abs diff of draft logits: {logit_max:.3e}; all tokens equal: {ok}")
    print("RESULT " + json.dumps({"max_abs_draft_logits": logit_max, "per_file": report, "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
