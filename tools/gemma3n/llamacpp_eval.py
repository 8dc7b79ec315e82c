#!/usr/bin/env python3
"""Run a GGUF through llama.cpp (llama-cpp-python, CPU) and save the logits of every position, plus ggml's CPU GELU
table (ggml_table_gelu_f16: llama.cpp's GELU rounds its input to fp16 and returns this table's fp16 value).

Runs under a python where `import llama_cpp` works (a llama-cpp-python 0.3.36 install, or its source package's
llama_cpp/ on PYTHONPATH with LLAMA_CPP_LIB_PATH pointing at a llama.cpp build's bin/). Needs numpy besides.
Two runs, each in a fresh context, f32 KV cache, flash attention off, one thread:
  prefill : all T ids in one llama_decode
  stepwise: one id per llama_decode (KV cache, sliding-window cache, KV-sharing reuse)
Usage: llamacpp_eval.py MODEL.gguf IDS_JSON OUT_PREFIX
Writes OUT_PREFIX_prefill.npy, OUT_PREFIX_stepwise.npy (float32 [T, n_vocab]), OUT_PREFIX_gelu_table.npy
(float16 [65536]) and prints one line 'RESULT {json}'.
"""
import ctypes, json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama

path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
T = len(ids)
res = {"llama_cpp_python": llama_cpp.__version__, "T": T}
for mode in ("prefill", "stepwise"):
    llm = Llama(model_path=path, n_ctx=max(64, T + 8), n_batch=max(32, T), n_ubatch=max(32, T), logits_all=True,
                n_threads=1, n_threads_batch=1, type_k=0, type_v=0, flash_attn=False, verbose=False, seed=0)
    llm.reset()
    if mode == "prefill":
        llm.eval(ids)
    else:
        for t in ids:
            llm.eval([t])
    sc = np.array(llm.scores[:T], dtype=np.float32)
    assert sc.shape == (T, llm.n_vocab()), sc.shape
    np.save(f"{out}_{mode}.npy", sc)
    res[mode] = {"absmax": float(np.abs(sc).max())}
    del llm
lib = ctypes.CDLL([l.split()[-1] for l in open("/proc/self/maps") if "libggml-cpu" in l][0])
tab = np.ctypeslib.as_array((ctypes.c_uint16 * 65536).in_dll(lib, "ggml_table_gelu_f16")).copy()
assert tab.any()
np.save(f"{out}_gelu_table.npy", tab.view(np.float16))
print("RESULT " + json.dumps(res))
