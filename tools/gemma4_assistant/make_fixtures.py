#!/usr/bin/env python3
"""Tiny random Gemma 4 target + assistant (drafter) pair and the assistant's drafts from transformers 5.23
(Gemma4ForCausalLM + Gemma4AssistantForCausalLM, CPU, f32, eager attention), plus llama.cpp GGUF twins.

Usage: python make_fixtures.py [OUT]            (default OUT: tests/data/gemma4-assistant)
  NO_GGUF=1 skips the GGUF twins; NO_LLAMACPP=1 skips running them through llama.cpp (llamacpp_assistant_eval.py,
  with LLAMA_CPP_LIB_PATH and LLCPP_PKG_SRC as described there). LLAMA_CPP_SRC points at llama.cpp's source tree (convert_hf_to_gguf.py);
  TINY_TOKENIZER at a folder with the 512-token tokenizer.json the Gemma 4 converter needs (default: the one in
  shared/oracle/gemma4/tiny-tokenizer-512).

Writes OUT/tiny-g4a-target-f32/, OUT/tiny-g4a-assistant-{f32,bf16}/ (config.json + model.safetensors),
OUT/tiny-g4a-{target,assistant}-f32.gguf and OUT/tiny-g4a-ref/ (see tests/data/gemma4-assistant/README.md).
Every .bin is raw little-endian float32, C order, no header.

Drafts are computed by calling the transformers modules directly (assistant_common.draft): the assistant reads
exactly the KV of the target's run over ids[:n-1]. transformers' assisted-generation loop is only used as a
cross-check of the first drafting round (before any rejection, where its KV is not stale).
"""
import copy, json, os, shutil, subprocess, sys, tempfile
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import assistant_common as A  # noqa: E402
from assistant_common import S, F  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/data/gemma4-assistant"
NO_GGUF = os.environ.get("NO_GGUF") == "1"
NO_LLAMACPP = NO_GGUF or os.environ.get("NO_LLAMACPP") == "1"
LLAMA_CPP_SRC = os.environ.get("LLAMA_CPP_SRC", os.path.expanduser(
    "~/.cache/pulsar-peers/llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp"))
TINY_TOKENIZER = os.environ.get("TINY_TOKENIZER", os.path.join(
    HERE, "..", "..", "..", "shared", "oracle", "gemma4", "tiny-tokenizer-512"))
if not os.path.isdir(TINY_TOKENIZER):
    TINY_TOKENIZER = "/work/shared/oracle/gemma4/tiny-tokenizer-512"
K = 8
TARGET_SEED = 401
FIRST_ASSISTANT_SEED = 402
MIN_MARGIN = 0.02
CASES = {  # name: (ids formula for ids[:n-1]; ids[n-1] is the target's argmax after them)
    "a": ("[2] + [4 + (37*i + 11) % 508 for i in range(5)]", 7),
    "b": ("[2] + [4 + (53*i + 29) % 508 for i in range(14)]", 16),
}


def save_model(model, d, dtype, hub_keys_in_text_config):
    model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(d)
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    (cfg["text_config"] if hub_keys_in_text_config else cfg).update(A.HUB_KEYS)
    A.dump_json(p, cfg)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(d, extra)):
            os.remove(os.path.join(d, extra))


def case_ids(target, formula):
    head = eval(formula)  # noqa: S307 (our own constant)
    logits, _, _ = A.run_target(target, head)
    return head + [int(torch.argmax(logits[-1]))]


def margins(res, k_top):
    """Smallest top-1 minus top-2 logit gap over the chain, and smallest gap between the k-th and (k+1)-th
    centroid score (0 if no centroid head)."""
    lg = np.sort(res["logits"], axis=-1)
    arg = float((lg[:, -1] - lg[:, -2]).min())
    cen = 0.0
    if "centroid_logits" in res:
        cl = np.sort(res["centroid_logits"], axis=-1)[:, ::-1]
        cen = float((cl[:, k_top - 1] - cl[:, k_top]).min())
    return arg, cen


def all_drafts(target, assistant, cases):
    out = {}
    for name, ids in cases.items():
        n = len(ids)
        out[name] = {"centroid": A.draft(target, assistant, ids, n, K, "centroid"),
                     "full": A.draft(target, assistant, ids, n, K, "full")}
    return out


def pick_assistant_seed(target, acfg, cases, tries=40):
    """First seed whose chains have argmax and top-k-cluster margins >= MIN_MARGIN (f32 and bf16-rounded weights),
    and whose centroid and full-head chains differ somewhere (so the mask matters)."""
    k_top = acfg.centroid_intermediate_top_k
    for seed in range(FIRST_ASSISTANT_SEED, FIRST_ASSISTANT_SEED + tries):
        a = A.Gemma4AssistantForCausalLM(acfg).eval()
        A.init_weights(a, seed)
        ok, differ, worst = True, False, []
        for dt in (torch.float32, torch.bfloat16):
            aa = a if dt == torch.float32 else copy.deepcopy(a).to(torch.bfloat16).float()
            dr = all_drafts(target, aa, cases)
            for name, c in dr.items():
                m1, m2 = margins(c["centroid"], k_top)
                m3, _ = margins(c["full"], k_top)
                worst.append(min(m1, m2, m3))
                ok &= min(m1, m2, m3) >= MIN_MARGIN
                differ |= c["centroid"]["tokens"] != c["full"]["tokens"]
        if ok and differ:
            return seed, a, seed - FIRST_ASSISTANT_SEED + 1, min(worst)
    raise RuntimeError("no assistant seed met the margins")


class F64Norms:
    """Gemma4RMSNorm upcasts to f32; for the f64 noise floor make it compute in the input dtype."""
    def __enter__(self):
        self.orig = A.g4.Gemma4RMSNorm.forward

        def fwd(mod, x):
            y = mod._norm(x)
            return y * mod.weight.to(x.dtype) if mod.with_scale else y
        A.g4.Gemma4RMSNorm.forward = fwd

    def __exit__(self, *exc):
        A.g4.Gemma4RMSNorm.forward = self.orig


def generate_first_round(target, assistant, ids):
    """transformers' own assisted generation from ids[:n-1]: the target's first token must be ids[n-1]; returns
    the K candidate tokens and logits of the first drafting round (no rejection has happened yet)."""
    from transformers.generation import candidate_generator as cg
    seen = []
    orig = cg.SinglePositionMultiTokenCandidateGenerator.get_candidates

    def spy(self, input_ids, *a, **kw):
        cand, logits = orig(self, input_ids, *a, **kw)
        if logits is not None:
            seen.append((input_ids.clone(), cand.clone(), logits.clone()))
        return cand, logits
    cg.SinglePositionMultiTokenCandidateGenerator.get_candidates = spy
    try:
        assistant.generation_config.num_assistant_tokens = K
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        target.generate(torch.tensor([ids[:-1]]), assistant_model=assistant, do_sample=False,
                        max_new_tokens=K + 2, pad_token_id=0)
    finally:
        cg.SinglePositionMultiTokenCandidateGenerator.get_candidates = orig
    inp, cand, logits = seen[0]
    assert inp[0].tolist() == ids, (inp[0].tolist(), ids)
    return cand[0, len(ids):].tolist(), logits[0].float().numpy()


def convert_gguf(hf_dir, out_gguf):
    with tempfile.TemporaryDirectory() as td:
        src = os.path.join(td, os.path.basename(hf_dir.rstrip("/")))
        shutil.copytree(hf_dir, src)
        for fn in os.listdir(TINY_TOKENIZER):
            shutil.copyfile(os.path.join(TINY_TOKENIZER, fn), os.path.join(src, fn))
        r = subprocess.run([sys.executable, os.path.join(LLAMA_CPP_SRC, "convert_hf_to_gguf.py"), src,
                            "--outfile", out_gguf, "--outtype", "f32"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf failed on {hf_dir}:\n" + r.stderr[-4000:])
    return [l for l in (r.stdout + r.stderr).splitlines() if "WARNING" in l]


def gguf_inventory(path, hf_dir):
    """Metadata and tensors of a GGUF; checks each tensor is bit-identical to the HF tensor of the same shape
    and values (matched by content, since the assistant's names have no gguf-py mapping table to rely on)."""
    sys.path.insert(0, os.path.join(LLAMA_CPP_SRC, "gguf-py"))
    import gguf
    from safetensors import safe_open
    rd = gguf.GGUFReader(path)
    meta = {}
    for k, f in rd.fields.items():
        if k.startswith("GGUF.") or k.startswith("tokenizer.ggml.") and k.endswith(("tokens", "scores", "token_type",
                                                                                     "merges")):
            continue
        v = f.contents()
        meta[k] = v.decode() if isinstance(v, (bytes, bytearray)) else v
    hf = {}
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        for k in f.keys():
            hf[k] = f.get_tensor(k)
    tensors = []
    for t in rd.tensors:
        arr = np.array(t.data, dtype=np.float32).reshape(-1)
        src = [k for k, v in hf.items() if v.is_floating_point() and v.numel() == arr.size
               and np.array_equal(v.float().numpy().reshape(-1), arr)]
        tensors.append({"name": t.name, "ggml_type": t.tensor_type.name, "ne": [int(x) for x in t.shape],
                        "from_hf": src[0] if len(src) == 1 else (src or None)})
    dropped = sorted(set(hf) - {t["from_hf"] for t in tensors if isinstance(t["from_hf"], str)})
    unmatched = [t["name"] for t in tensors if not isinstance(t["from_hf"], str) and t["name"] != "rope_freqs.weight"]
    assert not unmatched, f"{path}: GGUF tensors not bit-identical to exactly one HF tensor: {unmatched}"
    return {"metadata": meta, "tensors": tensors, "hf_tensors_not_in_gguf": dropped}


def llamacpp_check(out, ref, info):
    """Run both GGUFs through llama.cpp's shared-KV assistant path and compare with the full-head drafts."""
    res = {}
    with tempfile.TemporaryDirectory() as td:
        for name, c in info["cases"].items():
            ids, n = c["ids"], c["n"]
            r = subprocess.run([sys.executable, os.path.join(HERE, "llamacpp_assistant_eval.py"),
                                os.path.join(out, "tiny-g4a-target-f32.gguf"),
                                os.path.join(out, "tiny-g4a-assistant-f32.gguf"), json.dumps(ids), str(K),
                                os.path.join(td, name)], capture_output=True, text=True)
            line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                raise RuntimeError("llama.cpp run failed:\n" + r.stdout[-2000:] + r.stderr[-4000:])
            got = json.loads(line[-1][7:])
            t = np.load(os.path.join(td, name + "_target_logits.npy"))
            d = np.load(os.path.join(td, name + "_draft_logits.npy"))
            e = {"tokens": got["tokens"],
                 "target_logits_max_abs": float(np.abs(t - np.fromfile(os.path.join(ref, f"{name}_target_logits.bin"),
                                                                         "<f4").reshape(t.shape)).max())}
            for v in ("full_f32", f"full_f32_window{A.WINDOW - 1}"):
                f = os.path.join(ref, f"{name}_{v}_logits.bin")
                if os.path.exists(f):
                    refl = np.fromfile(f, "<f4").reshape(d.shape)
                    e[f"vs_{v}"] = {"max_abs_per_step": [float(x) for x in np.abs(d - refl).max(axis=1)],
                                    "same_tokens": got["tokens"] == c[f"tokens_{v}"]}
            res[name] = e
    return res


def main():
    os.makedirs(OUT, exist_ok=True)
    ref = os.path.join(OUT, "tiny-g4a-ref")
    os.makedirs(ref, exist_ok=True)
    tcfg, acfg = A.target_config(), A.assistant_config()

    # ---- target
    t0 = A.Gemma4ForCausalLM(tcfg).eval()
    t_rules = A.init_weights(t0, TARGET_SEED)
    tdir = os.path.join(OUT, "tiny-g4a-target-f32")
    save_model(t0, tdir, torch.float32, False)
    target = A.load_target(tdir)
    cases = {name: case_ids(target, f) for name, (f, n) in CASES.items()}
    for name, (f, n) in CASES.items():
        assert len(cases[name]) == n

    # ---- assistant
    seed, a0, tried, worst = pick_assistant_seed(target, acfg, cases)
    a_rules = A.init_weights(a0, seed)  # same draw again (the rules dict)
    adir = {dt: os.path.join(OUT, f"tiny-g4a-assistant-{dt}") for dt in ("f32", "bf16")}
    save_model(a0, adir["f32"], torch.float32, True)
    save_model(a0, adir["bf16"], torch.bfloat16, True)
    asst = {"f32": A.load_assistant(adir["f32"]), "bf16": A.load_assistant(adir["bf16"], torch.float32)}

    info = {"versions": A.versions(), "K": K, "target_seed": TARGET_SEED, "assistant_seed": seed,
            "assistant_seed_search": f"first seed from {FIRST_ASSISTANT_SEED} whose draft chains (centroid and "
                                     f"full head, f32 and bf16 weights, both cases) keep top-1/top-2 and "
                                     f"k-th/(k+1)-th centroid margins >= {MIN_MARGIN} and whose centroid and full "
                                     f"chains differ; tried {tried}; smallest margin {worst:.4f}",
            "weight_init": {"target": t_rules, "assistant": a_rules}, "cases": {}}
    files = {}

    def put(name, arr):
        files[name] = A.save_bin(os.path.join(ref, name), arr)

    W = tcfg.sliding_window
    for name, ids in cases.items():
        n = len(ids)
        c = {"ids": ids, "n": n, "ids_formula": CASES[name][0] + " + [target argmax]", "position": n - 1}
        logits, hid, kv = A.run_target(target, ids[:n - 1])
        put(f"{name}_target_logits.bin", logits.numpy())
        put(f"{name}_target_final_hidden.bin", hid.numpy())
        for lt, short in ((S, "sliding"), (F, "full")):
            put(f"{name}_target_kv_{short}_k.bin", kv[lt][0][0].numpy())
            put(f"{name}_target_kv_{short}_v.bin", kv[lt][1][0].numpy())
        for dt in ("f32", "bf16"):
            for head in ("centroid", "full"):
                r = A.draft(target, asst[dt], ids, n, K, head)
                tag = f"{name}_{head}_{dt}"
                c[f"tokens_{head}_{dt}"] = r["tokens"]
                put(f"{tag}_logits.bin", r["logits"])
                if dt == "f32":
                    c[f"top_clusters_{head}"] = r["top_clusters"]
                    c[f"margins_{head}"] = dict(zip(("argmax", "centroid_topk"),
                                                    margins(r, acfg.centroid_intermediate_top_k)))
                    for key in ("inputs", "pre_projection", "layers", "final_norm", "post_projection",
                                "centroid_logits", "full_logits"):
                        put(f"{tag}_{key}.bin", r[key])
        for head in ("centroid", "full"):
            lg = {dt: np.fromfile(os.path.join(ref, f"{name}_{head}_{dt}_logits.bin"), "<f4") for dt in ("f32", "bf16")}
            c[f"bf16_vs_f32_max_abs_{head}"] = float(np.abs(lg["bf16"] - lg["f32"]).max())
        # other engines' sliding rule: only the last W-1 target positions (causal window at position n-1)
        if n - 1 > W - 1:
            for head in ("centroid", "full"):
                r = A.draft(target, asst["f32"], ids, n, K, head, sliding_keys=W - 1)
                c[f"tokens_{head}_f32_window{W - 1}"] = r["tokens"]
                put(f"{name}_{head}_f32_window{W - 1}_logits.bin", r["logits"])
        # f64 noise floor: the same chain computed in float64
        with F64Norms():
            t64, a64 = copy.deepcopy(target).double(), copy.deepcopy(asst["f32"]).double()
            for head in ("centroid", "full"):
                r = A.draft(t64, a64, ids, n, K, head)
                r32 = np.fromfile(os.path.join(ref, f"{name}_{head}_f32_logits.bin"), "<f4").reshape(K, -1)
                assert r["tokens"] == c[f"tokens_{head}_f32"]
                c[f"f32_vs_f64_max_abs_{head}"] = float(np.abs(r["logits"] - r32).max())
        # transformers' own assisted loop, first round
        gt, gl = generate_first_round(target, asst["f32"], ids)
        mine = np.fromfile(os.path.join(ref, f"{name}_centroid_f32_logits.bin"), "<f4").reshape(K, -1)
        c["generate_first_round"] = {"tokens": gt, "same_tokens": gt == c["tokens_centroid_f32"],
                                     "max_abs_vs_centroid_f32_logits": float(np.abs(gl - mine).max())}
        info["cases"][name] = c
        print(name, json.dumps({k: v for k, v in c.items() if not k.startswith("top_clusters")}))

    info["files"] = {k: {"shape": v, "dtype": "float32 little-endian, C order"} for k, v in sorted(files.items())}
    if not NO_GGUF:
        info["gguf"] = {}
        for what, d in (("target", tdir), ("assistant", adir["f32"])):
            g = os.path.join(OUT, f"tiny-g4a-{what}-f32.gguf")
            warn = convert_gguf(d, g)
            inv = gguf_inventory(g, d)
            inv["converter_warnings"] = warn
            info["gguf"][what] = inv
        if not NO_LLAMACPP:
            info["llamacpp_cross_check"] = llamacpp_check(OUT, ref, info)
    A.dump_json(os.path.join(ref, "reference.json"), info)
    print("done")


if __name__ == "__main__":
    main()
