#!/usr/bin/env python3
"""Write a Gemma 4 GGUF of a released model's text shape with random weights, in the layout
llama.cpp's converter writes (`gemma4.*` keys, per-layer arrays, rope_freqs, fused expert
tensors), and the real Gemma 4 tokenizer, so Pulsar and llama.cpp run the same file at real
sizes. `--type q4_k_m` writes random K-quant blocks directly in the mix `llama-quantize ... Q4_K_M`
gives (Q4_K; Q6_K for the embedding and for attn_v and ffn_down on llama.cpp's "more bits"
layers; Q5_0 and Q8_0 where a row is not whole 256-value super-blocks), which saves requantizing
a 26B file (about 90 minutes on 2 cores).

usage: make_gemma4_shape_gguf.py SHAPE OUT.gguf [--type q8_0|q4_0|q4_k_m]
    SHAPE: gemma4-e2b | gemma4-e4b | gemma4-26b-a4b | gemma4-31b
Needs Python with gguf==0.19.0 and numpy (a throwaway venv). Tensors are written one at a
time, so memory holds one tensor (the E2B's per-layer table, 2.5 GB, is the largest). The tokenizer is read from
../shared/oracle/gemma4/ggml-vocab-gemma-4.gguf (override with GEMMA4_VOCAB)."""
import os
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shape_gguf_common import BLOCK, GGML, blocks, copy_tokenizer  # noqa: E402

# hidden, layers, heads, kv heads (sliding, full), ffn, double-wide, window, sliding per full,
# per-layer input width, KV-shared layers, k = v on full layers, (experts, used, width), context
SHAPES = {
    'gemma4-e2b': (1536, 35, 8, (1, 1), 6144, True, 512, 4, 256, 20, False, None, 131072),
    'gemma4-e4b': (2560, 42, 8, (2, 2), 10240, False, 512, 5, 256, 18, False, None, 131072),
    'gemma4-26b-a4b': (2816, 30, 16, (8, 2), 2112, False, 1024, 5, 0, 0, True, (128, 8, 704),
                       262144),
    'gemma4-31b': (5376, 60, 32, (16, 4), 21504, False, 1024, 5, 0, 0, True, None, 262144),
}
HEAD_DIM, GLOBAL_HEAD_DIM, VOCAB = 256, 512, 262144
ROTATED_PAIRS = 64  # partial_rotary_factor 0.25 of 512 dims, in pairs
HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_FILE = os.environ.get(
    'GEMMA4_VOCAB', os.path.join(HERE, '..', '..', 'shared', 'oracle', 'gemma4',
                                 'ggml-vocab-gemma-4.gguf'))


def main():
    args = sys.argv[1:]
    kind = 'q8_0'
    if '--type' in args:
        i = args.index('--type')
        kind = args[i + 1]
        del args[i:i + 2]
    if len(args) != 2 or args[0] not in SHAPES or kind not in ('q8_0', 'q4_0', 'q4_k_m'):
        sys.exit(__doc__)
    shape, out = args
    (h, n_layers, n_heads, (kv_sliding, kv_full), ffn, double_wide, window, per_full, ple,
     shared, k_eq_v, moe, ctx) = SHAPES[shape]
    sliding = [(i + 1) % (per_full + 1) != 0 and i + 1 != n_layers for i in range(n_layers)]
    first_shared = n_layers - shared
    ffn_widths = [2 * ffn if double_wide and i >= first_shared else ffn for i in range(n_layers)]
    kv_heads = [kv_sliding if s else kv_full for s in sliding]

    w = gguf.GGUFWriter(out, 'gemma4')
    w.add_name(f'Gemma 4 {shape} random')
    w.add_context_length(ctx)
    w.add_embedding_length(h)
    w.add_block_count(n_layers)
    if double_wide:
        w.add_feed_forward_length(ffn_widths)
    else:
        w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(GLOBAL_HEAD_DIM)
    w.add_value_length(GLOBAL_HEAD_DIM)
    w.add_uint32('gemma4.attention.key_length_swa', HEAD_DIM)
    w.add_uint32('gemma4.attention.value_length_swa', HEAD_DIM)
    w.add_rope_dimension_count(GLOBAL_HEAD_DIM)
    w.add_uint32('gemma4.rope.dimension_count_swa', HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_float32('gemma4.rope.freq_base_swa', 1e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    w.add_array('gemma4.attention.sliding_window_pattern', sliding)
    w.add_uint32('gemma4.attention.shared_kv_layers', shared)
    w.add_uint32('gemma4.embedding_length_per_layer_input', ple)
    w.add_float32('gemma4.final_logit_softcapping', 30.0)
    if moe:
        w.add_expert_count(moe[0])
        w.add_expert_used_count(moe[1])
        w.add_uint32('gemma4.expert_feed_forward_length', moe[2])
    w.add_file_type({'q8_0': gguf.LlamaFileType.MOSTLY_Q8_0,
                     'q4_0': gguf.LlamaFileType.MOSTLY_Q4_0,
                     'q4_k_m': gguf.LlamaFileType.MOSTLY_Q4_K_M}[kind])

    copy_tokenizer(w, VOCAB_FILE)

    # (name, numpy shape, f32 fill or None for random quantized rows)
    plan = []
    freqs = np.array([1.0] * ROTATED_PAIRS + [1e30] * (GLOBAL_HEAD_DIM // 2 - ROTATED_PAIRS),
                     dtype=np.float32)
    plan.append(('rope_freqs.weight', freqs.shape, freqs))
    plan.append(('token_embd.weight', (VOCAB, h), None))
    if ple:
        plan.append(('per_layer_token_embd.weight', (VOCAB, n_layers * ple), None))
        plan.append(('per_layer_model_proj.weight', (n_layers * ple, h), None))
        plan.append(('per_layer_proj_norm.weight', (ple,), 1.0))
    plan.append(('output_norm.weight', (h,), 1.0))
    for i in range(n_layers):
        hd = HEAD_DIM if sliding[i] else GLOBAL_HEAD_DIM
        b = f'blk.{i}.'
        plan += [(b + 'attn_norm.weight', (h,), 1.0),
                 (b + 'attn_q.weight', (n_heads * hd, h), None),
                 (b + 'attn_q_norm.weight', (hd,), 1.0),
                 (b + 'attn_output.weight', (h, n_heads * hd), None),
                 (b + 'post_attention_norm.weight', (h,), 1.0),
                 (b + 'ffn_norm.weight', (h,), 1.0),
                 (b + 'ffn_gate.weight', (ffn_widths[i], h), None),
                 (b + 'ffn_up.weight', (ffn_widths[i], h), None),
                 (b + 'ffn_down.weight', (h, ffn_widths[i]), None),
                 (b + 'post_ffw_norm.weight', (h,), 1.0),
                 (b + 'layer_output_scale.weight', (1,), 1.0)]
        if i < first_shared:
            plan += [(b + 'attn_k.weight', (kv_heads[i] * hd, h), None),
                     (b + 'attn_k_norm.weight', (hd,), 1.0)]
            if sliding[i] or not k_eq_v:
                plan.append((b + 'attn_v.weight', (kv_heads[i] * hd, h), None))
        if ple:
            plan += [(b + 'inp_gate.weight', (ple, h), None),
                     (b + 'proj.weight', (h, ple), None),
                     (b + 'post_norm.weight', (h,), 1.0)]
        if moe:
            n_exp, _, width = moe
            plan += [(b + 'ffn_gate_inp.weight', (n_exp, h), 'router'),
                     (b + 'ffn_gate_inp.scale', (h,), 1.0),
                     (b + 'ffn_down_exps.scale', (n_exp,), 1.0),
                     (b + 'ffn_gate_up_exps.weight', (n_exp, 2 * width, h), None),
                     (b + 'ffn_down_exps.weight', (n_exp, h, width), None),
                     (b + 'pre_ffw_norm_2.weight', (h,), 1.0),
                     (b + 'post_ffw_norm_1.weight', (h,), 1.0),
                     (b + 'post_ffw_norm_2.weight', (h,), 1.0)]

    def more_bits(layer):
        # llama.cpp's use_more_bits: the first and last eighth, and every third between.
        eighth = n_layers // 8
        return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2

    def type_of(name, shape):
        """The type a matrix gets, None for f32 (rows not whole 32-value blocks)."""
        if shape[-1] % 32 != 0 or len(shape) < 2:
            return None
        if kind != 'q4_k_m':
            return kind
        wide = name == 'token_embd.weight'
        if name.startswith('blk.') and name.split('.')[2] in ('attn_v', 'ffn_down',
                                                               'ffn_down_exps'):
            wide = more_bits(int(name.split('.')[1]))
        if shape[-1] % 256 != 0:
            return 'q8_0' if wide else 'q5_0'
        return 'q6_k' if wide else 'q4_k'

    for name, shp, fill in plan:
        qt = type_of(name, shp) if fill is None else None
        if qt:
            size, per = BLOCK[qt]
            byte_shape = (*shp[:-1], shp[-1] // per * size)
            nbytes = int(np.prod(byte_shape))
            # gguf-py takes a quantized tensor's shape in bytes.
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=GGML[qt])
        else:
            n = int(np.prod(shp))
            w.add_tensor_info(name, shp, np.dtype(np.float32), n * 4,
                              raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(4)
    for name, shp, fill in plan:
        qt = type_of(name, shp) if fill is None else None
        if qt:
            rows = int(np.prod(shp[:-1]))
            w.write_tensor_data(blocks(qt, rows, shp[-1], rng))
        elif isinstance(fill, str):
            w.write_tensor_data(rng.normal(0, 0.5, size=shp).astype(np.float32))
        else:
            w.write_tensor_data(np.full(shp, fill, dtype=np.float32))
        print(name, shp, file=sys.stderr) if os.environ.get('VERBOSE') else None
    w.close()


if __name__ == '__main__':
    main()
