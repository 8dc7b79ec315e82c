#!/usr/bin/env python3
"""Write a Gemma 3n GGUF of a released model's text shape with random weights, in the layout
llama.cpp's converter (`Gemma3NModel`) writes: `gemma3n.*` keys with the per-layer arrays
(MLP widths, sliding pattern, sparsity multipliers), the stacked AltUp projections, every layer's
AltUp, LAuReL and per-layer-input tensors, K and V on the KV-sharing layers too (llama.cpp's
loader wants them), and the vocabulary padded to 262,400 rows. Pulsar and llama.cpp run the same
file at real sizes. Quantize it further with `llama-quantize --allow-requantize IN OUT Q4_K_M`
for the mix users download.

usage: make_gemma3n_shape_gguf.py SHAPE OUT.gguf [--type q8_0|q4_0]
    SHAPE: gemma3n-e2b | gemma3n-e4b
Needs Python with gguf==0.19.0 and numpy (a throwaway venv). Tensors are written one at a
time, so memory holds one tensor (the per-layer table, 2.1 GB in Q8_0 on E2B, is the largest).

The tokenizer is Gemma 3's SentencePiece vocabulary (262,144 pieces; Gemma 3n's differs only in
a few special pieces), read from a Gemma 3 GGUF (default: the default model,
~/.cache/pulsar/gemma-3-270m-q4_k_m.gguf; override with GEMMA3_VOCAB) and padded with unused
`[PADn]` pieces to the 262,400 ids of the embedding, as the converter pads Gemma 3n's."""
import os
import sys

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shape_gguf_common import BLOCK, blocks, copy_tokenizer  # noqa: E402

# layers, MLP width, KV-sharing layers (transformers' Gemma3nTextConfig; the rest is common)
SHAPES = {
    'gemma3n-e2b': (30, 8192, 10),
    'gemma3n-e4b': (35, 16384, 15),
}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 8, 2, 256
VOCAB, PER_LAYER_INPUT, ALTUP, LAUREL_RANK = 262400, 256, 4, 64
WINDOW, SPARSE_LAYERS = 512, 10
# Phi^-1(0.95) in f32, what the converter writes for a sparsity target of 0.95.
SPARSITY_CUT = 1.6448535919189453
VOCAB_FILE = os.environ.get(
    'GEMMA3_VOCAB', os.path.expanduser('~/.cache/pulsar/gemma-3-270m-q4_k_m.gguf'))


def main():
    args = sys.argv[1:]
    kind = 'q8_0'
    if '--type' in args:
        i = args.index('--type')
        kind = args[i + 1]
        del args[i:i + 2]
    if len(args) != 2 or args[0] not in SHAPES or kind not in ('q8_0', 'q4_0'):
        sys.exit(__doc__)
    shape, out = args
    n_layers, ffn, shared = SHAPES[shape]
    h, hd, p = HIDDEN, HEAD_DIM, PER_LAYER_INPUT
    qtype = gguf.GGMLQuantizationType.Q8_0 if kind == 'q8_0' else gguf.GGMLQuantizationType.Q4_0
    # transformers' default layer_types: every fifth layer full.
    sliding = [(i + 1) % 5 != 0 for i in range(n_layers)]

    w = gguf.GGUFWriter(out, 'gemma3n')
    w.add_name(f'Gemma 3n {shape} random')
    w.add_context_length(32768)
    w.add_embedding_length(h)
    w.add_block_count(n_layers)
    w.add_feed_forward_length([ffn] * n_layers)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_float32('gemma3n.rope.freq_base_swa', 1e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)
    w.add_sliding_window_pattern(sliding)
    w.add_final_logit_softcapping(30.0)
    w.add_altup_active_idx(0)
    w.add_altup_num_inputs(ALTUP)
    w.add_embedding_length_per_layer_input(p)
    w.add_shared_kv_layers(shared)
    w.add_activation_sparsity_scale(
        [SPARSITY_CUT if i < SPARSE_LAYERS else float('-inf') for i in range(n_layers)])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if kind == 'q8_0'
                    else gguf.LlamaFileType.MOSTLY_Q4_0)
    copy_tokenizer(w, VOCAB_FILE, pad_to=VOCAB)

    # (name, numpy shape, fill): None for random quantized rows, a number for a constant f32
    # tensor, 'coef' for small random f32 values (the converter keeps AltUp's coefficient
    # matrices in f32 whatever the output type).
    plan = [('token_embd.weight', (VOCAB, h), None),
            ('per_layer_token_embd.weight', (VOCAB, n_layers * p), None),
            ('per_layer_model_proj.weight', (n_layers * p, h), None),
            ('per_layer_proj_norm.weight', (p,), 1.0),
            ('altup_proj.weight', (ALTUP - 1, h, h), None),
            ('altup_unembd_proj.weight', (ALTUP - 1, h, h), None),
            ('output_norm.weight', (h,), 1.0)]
    for i in range(n_layers):
        b = f'blk.{i}.'
        plan += [(b + 'attn_norm.weight', (h,), 1.0),
                 (b + 'attn_q.weight', (HEADS * hd, h), None),
                 (b + 'attn_k.weight', (KV_HEADS * hd, h), None),
                 (b + 'attn_v.weight', (KV_HEADS * hd, h), None),
                 (b + 'attn_output.weight', (h, HEADS * hd), None),
                 (b + 'attn_q_norm.weight', (hd,), 1.0),
                 (b + 'attn_k_norm.weight', (hd,), 1.0),
                 (b + 'post_attention_norm.weight', (h,), 1.0),
                 (b + 'ffn_norm.weight', (h,), 1.0),
                 (b + 'ffn_gate.weight', (ffn, h), None),
                 (b + 'ffn_up.weight', (ffn, h), None),
                 (b + 'ffn_down.weight', (h, ffn), None),
                 (b + 'post_ffw_norm.weight', (h,), 1.0),
                 (b + 'inp_gate.weight', (p, h), None),
                 (b + 'proj.weight', (h, p), None),
                 (b + 'post_norm.weight', (h,), 1.0),
                 (b + 'altup_correct_coef.weight', (ALTUP, ALTUP), 'coef'),
                 (b + 'altup_correct_scale.weight', (h,), 1.0),
                 (b + 'altup_predict_coef.weight', (ALTUP * ALTUP, ALTUP), 'coef'),
                 (b + 'altup_router.weight', (ALTUP, h), None),
                 (b + 'altup_router_norm.weight', (h,), 1.0),
                 (b + 'laurel_l.weight', (LAUREL_RANK, h), None),
                 (b + 'laurel_r.weight', (h, LAUREL_RANK), None),
                 (b + 'laurel_post_norm.weight', (h,), 1.0)]

    def quantized(shp, fill):
        return fill is None and shp[-1] % 32 == 0 and len(shp) >= 2

    for name, shp, fill in plan:
        if quantized(shp, fill):
            size, per = BLOCK[kind]
            byte_shape = (*shp[:-1], shp[-1] // per * size)
            # gguf-py takes a quantized tensor's shape in bytes.
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=qtype)
        else:
            w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4,
                              raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(3)
    for name, shp, fill in plan:
        if quantized(shp, fill):
            rows = int(np.prod(shp[:-1]))
            w.write_tensor_data(blocks(kind, rows, shp[-1], rng))
        elif fill == 'coef':
            w.write_tensor_data(rng.normal(0, 0.05, size=shp).astype(np.float32))
        else:
            w.write_tensor_data(np.full(shp, fill, dtype=np.float32))
        if os.environ.get('VERBOSE'):
            print(name, shp, file=sys.stderr)
    w.close()


if __name__ == '__main__':
    main()
