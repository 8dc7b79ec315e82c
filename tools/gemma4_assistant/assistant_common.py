"""Shared pieces of the Gemma 4 assistant fixture generator: the transformers 5.23 config patch, the tiny configs,
seeded weights, the clean drafting driver, and file helpers.

transformers is imported here (not in numpy_reference.py, which must stay independent of it).
"""
import json, os
import numpy as np
import torch
import transformers
from transformers import Gemma4TextConfig, Gemma4ForCausalLM
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM
import transformers.models.gemma4.modeling_gemma4 as g4

S, F = "sliding_attention", "full_attention"
torch.set_grad_enabled(False)
torch.set_num_threads(int(os.environ.get("ORACLE_THREADS", "1")))

# ----------------------------------------------------------------------------------------------- the config patch
# transformers 5.23 derives kv_sharing_modes from the layers before the first shared one; an assistant shares all
# of its layers, so that list is empty and the property raises "The set of layer types producing a cache is
# different ...". Every layer of an assistant reuses the target's KV: return "reuse" for all of them.
_orig_modes = Gemma4TextConfig.kv_sharing_modes


def _kv_sharing_modes(self):
    if self.num_kv_shared_layers and self.num_kv_shared_layers == self.num_hidden_layers:
        return ["reuse"] * self.num_hidden_layers
    return _orig_modes.fget(self)


Gemma4TextConfig.kv_sharing_modes = property(_kv_sharing_modes)

# ----------------------------------------------------------------------------------------------- tiny configs
ROPE = {S: {"rope_type": "default", "rope_theta": 10000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}
COMMON = dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, max_position_embeddings=512,
              tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0, attention_bias=False)
WINDOW = 8
VOCAB = 512
HUB_KEYS = {"global_head_dim": 64, "num_global_key_value_heads": 1}   # the real configs carry these; HF ignores them


def target_config():
    """E2B-like target: PLE, KV sharing (layers 3,4 reuse layer 1; layer 5 reuses layer 2), double-wide MLP on the
    shared layers, k=v full layers, final softcap 30. The assistant reads layer 1 (sliding) and layer 2 (full)."""
    types = [S, S, F, S, S, F]
    cfg = Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_k_eq_v=True,
                           layer_types=types, sliding_window=WINDOW, rope_parameters=ROPE,
                           vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, num_kv_shared_layers=3,
                           use_double_wide_mlp=True, final_logit_softcapping=30.0, enable_moe_block=False,
                           **HUB_KEYS, **COMMON)
    assert cfg.layer_types == types and cfg.kv_sharing_modes == [None, "store", "store", "reuse", "reuse", "reuse"]
    return cfg


def assistant_config():
    """The released assistants' structure (4 layers S S S F, every layer KV-shared, no PLE, no MoE, no softcap,
    tied head, hidden smaller than the target's), with E2B/E4B's centroid head (use_ordered_embeddings) and
    26B/31B's k=v attention layout (full layers: 1 KV head of width 64; sliding: 2 KV heads of width 32), so the
    drafter's two layer types read KV of different head counts and widths."""
    types = [S, S, S, F]
    text = Gemma4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_k_eq_v=True,
                            layer_types=types, sliding_window=WINDOW, rope_parameters=ROPE,
                            vocab_size_per_layer_input=0, hidden_size_per_layer_input=0, num_kv_shared_layers=4,
                            use_double_wide_mlp=False, final_logit_softcapping=None, enable_moe_block=False,
                            **HUB_KEYS, **COMMON)
    assert text.kv_sharing_modes == ["reuse"] * 4
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, use_ordered_embeddings=True,
                                num_centroids=16, centroid_intermediate_top_k=4, tie_word_embeddings=True)
    return cfg


# ----------------------------------------------------------------------------------------------- weights
STD = {"embed_tokens.weight": 0.15, "embed_tokens_per_layer.weight": 0.15, "gate_proj.weight": 0.08,
       "up_proj.weight": 0.08, "pre_projection.weight": 0.05, "post_projection.weight": 0.1,
       "masked_embedding.centroids.weight": 0.3}


def init_weights(model, seed):
    """Draw every parameter in named_parameters() order right after torch.manual_seed(seed), then the layer_scalar
    buffers, then (assistant) token_ordering = a random permutation. Returns {name: rule}."""
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, g4.Gemma4RMSNorm) and m.with_scale}
    torch.manual_seed(seed)
    rules = {}
    for name, p in model.named_parameters():
        if name in norms:
            p.uniform_(0.5, 1.5)
            rules[name] = "U[0.5,1.5]"
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                p.mul_(p.numel() ** -0.25)          # attention scale is 1.0: spread 1/sqrt(head_dim) over q and k
                rules[name] = "U[0.5,1.5] * head_dim^-1/4"
        else:
            std = next((s for k, s in STD.items() if name.endswith(k)), 0.02)
            p.normal_(0.0, std)
            rules[name] = f"N(0,{std}^2)"
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.uniform_(0.5, 1.5)
            rules[name] = "U[0.5,1.5]"
        if name.endswith("token_ordering"):
            b.copy_(torch.randperm(b.numel()))
            rules[name] = "randperm(vocab) after the parameters"
    return rules


def load_target(d, dtype=torch.float32):
    return Gemma4ForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager").eval()


def load_assistant(d, dtype=torch.float32):
    return Gemma4AssistantForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager").eval()


# ----------------------------------------------------------------------------------------------- the clean driver
def run_target(target, prefix):
    """The target over prefix (no cache): logits [T,V], final-norm hidden [T,H], and the KV the assistant reads
    ({layer_type: (K, V)}, each [1, kv_heads, T, head_dim]: post-k_norm, post-RoPE K; post-v_norm V)."""
    out = target(input_ids=torch.tensor([prefix]), use_cache=False, output_hidden_states=True,
                 return_shared_kv_states=True)
    kv = {k: (v[0].clone(), v[1].clone()) for k, v in out.shared_kv_states.items()}
    return out.logits[0].float(), out.hidden_states[-1][0].float(), kv


def draft(target, assistant, ids, n, k_drafts, head="centroid", sliding_keys=None):
    """K drafts after the target has run ids[:n-1]: the first draft step is fed ids[n-1] at position n-1 and the
    target's final-norm hidden state at n-2; each later step is fed the previous step's argmax and post-projection
    output, at the same position n-1. head: "centroid" (masked, transformers' default for this config) or "full"
    (the tied head over the whole vocabulary). sliding_keys: None = transformers' own sliding mask; an int m = let
    the sliding layers see only the last m target positions (to emulate other engines). Returns a dict of arrays."""
    _, hid, kv = run_target(target, ids[:n - 1])
    if sliding_keys is not None:
        k_s, v_s = kv[S]
        kv[S] = (k_s[:, :, -sliding_keys:], v_s[:, :, -sliding_keys:])
    emb = target.get_input_embeddings()
    tok, h = ids[n - 1], hid[n - 2][None, None, :]
    rec = {k: [] for k in ("tokens", "inputs", "pre_projection", "layers", "final_norm", "post_projection",
                           "centroid_logits", "top_clusters", "logits", "full_logits")}
    mm = assistant.model
    cap = {}
    hooks = [assistant.pre_projection.register_forward_hook(lambda m, i, o: cap.__setitem__("pre", o)),
             mm.norm.register_forward_hook(lambda m, i, o: cap.__setitem__("norm", o))]
    for li, layer in enumerate(mm.layers):
        hooks.append(layer.register_forward_hook((lambda li: lambda m, i, o: cap.__setitem__(li, o))(li)))
    use_ordered = assistant.config.use_ordered_embeddings
    try:
        assistant.config.use_ordered_embeddings = (head == "centroid") and use_ordered
        for _ in range(k_drafts):
            x = torch.cat([emb(torch.tensor([[tok]])), h.to(emb.weight.dtype)], dim=-1)
            out = assistant(inputs_embeds=x, position_ids=torch.tensor([[n - 1]]), shared_kv_states=kv,
                            attention_mask=None, use_cache=False)
            logits = out.logits[0, 0].float()
            rec["inputs"].append(x[0, 0].float())
            rec["pre_projection"].append(cap["pre"][0, 0].float())
            rec["layers"].append(torch.stack([cap[li][0, 0].float() for li in range(len(mm.layers))]))
            rec["final_norm"].append(cap["norm"][0, 0].float())
            rec["post_projection"].append(out.last_hidden_state[0, 0].float())
            rec["logits"].append(logits)
            normed = cap["norm"][0, 0]
            rec["full_logits"].append((normed @ assistant.lm_head.weight.T).float())
            if use_ordered:
                cl = assistant.masked_embedding.centroids(normed).float()
                rec["centroid_logits"].append(cl)
                rec["top_clusters"].append(torch.topk(cl, assistant.config.centroid_intermediate_top_k).indices)
            tok = int(torch.argmax(logits))
            rec["tokens"].append(tok)
            h = out.last_hidden_state
    finally:
        assistant.config.use_ordered_embeddings = use_ordered
        for hk in hooks:
            hk.remove()
    res = {"tokens": rec.pop("tokens"), "top_clusters": [t.tolist() for t in rec.pop("top_clusters")]}
    for k, v in rec.items():
        if v:
            res[k] = torch.stack(v).numpy()
    return res


# ----------------------------------------------------------------------------------------------- files
def save_bin(path, arr):
    """Raw little-endian float32, C order, no header. Returns the shape."""
    arr = np.ascontiguousarray(arr, dtype="<f4")
    arr.tofile(path)
    return list(arr.shape)


def versions():
    import safetensors
    return {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "safetensors": safetensors.__version__}


def dump_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
