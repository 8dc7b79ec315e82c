#!/usr/bin/env python3
"""Run the GGUF target and the GGUF assistant through llama.cpp (its C API through llama-cpp-python's ctypes
bindings, CPU, one thread, f32 KV cache, no flash attention) the way llama.cpp's own speculative drafting does
(common/speculative.cpp, the shared-memory Gemma 4 assistant path), and save what it gives.

The target context decodes ids[:n-1] in one batch with its post-final-norm hidden states exposed
(llama_set_embeddings_nextn). A second context on the assistant GGUF is attached to it (ctx_other = the target's
context, so the assistant reads the target's KV cache). Each draft step decodes one entry: token = the last token,
embedding = h (the target's hidden at n-2 for the first step, then the assistant's own h_nextn), position n-1 for
every step; its logits and h_nextn are read back; the next token is the argmax.

Usage: llamacpp_assistant_eval.py TARGET.gguf ASSISTANT.gguf IDS_JSON K OUT_PREFIX
Needs numpy and typing_extensions. LLAMA_CPP_LIB_PATH: the folder with libllama.so (default
~/.cache/pulsar-peers/llama.cpp/bin); LLCPP_PKG_SRC: llama-cpp-python's llama_cpp/ source folder, whose
llama_cpp.py and _ctypes_extensions.py are loaded on their own (default: the 0.3.36 source package's).
Writes OUT_PREFIX_target_logits.npy [n-1, V], OUT_PREFIX_draft_logits.npy [K, V], OUT_PREFIX_draft_h.npy [K, H_t]
and prints one line 'RESULT {json}'.
"""
import atexit, ctypes, json, os, shutil, sys, tempfile
import numpy as np

BIN = os.path.expanduser("~/.cache/pulsar-peers/llama.cpp/bin")
os.environ.setdefault("LLAMA_CPP_LIB_PATH", BIN)
PKG_SRC = os.environ.get("LLCPP_PKG_SRC", os.path.expanduser(
    "~/.cache/pulsar-peers/llama.cpp/src/llama_cpp_python-0.3.36/llama_cpp"))

# llama-cpp-python's package __init__ pulls in its high-level API and its dependencies; only the ctypes layer
# is needed, so load those two files as a package of their own.
_stub = tempfile.mkdtemp()
atexit.register(shutil.rmtree, _stub, True)
os.makedirs(os.path.join(_stub, "llama_cpp"))
open(os.path.join(_stub, "llama_cpp", "__init__.py"), "w").close()
for fn in ("llama_cpp.py", "_ctypes_extensions.py"):
    shutil.copyfile(os.path.join(PKG_SRC, fn), os.path.join(_stub, "llama_cpp", fn))
sys.path.insert(0, _stub)
import llama_cpp.llama_cpp as C  # noqa: E402

# The embeddings_nextn calls are in llama.cpp's staging C++ header (src/llama-ext.h), so exported mangled.
_set_nextn = C._lib._Z26llama_set_embeddings_nextnP13llama_contextbb
_set_nextn.argtypes, _set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
_get_nextn_ith = C._lib._Z30llama_get_embeddings_nextn_ithP13llama_contexti
_get_nextn_ith.argtypes, _get_nextn_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)


def context(model, other=None):
    p = C.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = 64, 64, 64, 1
    p.n_threads = p.n_threads_batch = 1
    p.type_k = p.type_v = 0                      # GGML_TYPE_F32
    p.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if other is not None:
        p.ctx_other = other
    ctx = C.llama_init_from_model(model, p)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    return ctx


def decode(ctx, entries):
    """entries: [(token, pos, h or None, want_logits)]"""
    b = C.llama_batch_ext_init(ctx)
    keep = []
    for tok, pos, h, out in entries:
        idx = C.llama_batch_ext_add_token(b, 0, tok)
        assert idx >= 0, idx
        p = (C.llama_pos * 1)(pos)
        keep.append(p)
        assert C.llama_batch_ext_set_pos(b, idx, p)
        if h is not None:
            buf = np.ascontiguousarray(h, dtype=np.float32)
            keep.append(buf)
            e = C.llama_embd(buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, buf.size)
            assert C.llama_batch_ext_set_embd_token(b, idx, e)
        if out:
            assert C.llama_batch_ext_set_output_logits(b, idx, True)
    rc = C.llama_process(ctx, C.LLAMA_PROCESS_TYPE_DECODE, b)
    C.llama_batch_ext_free(b)
    if rc != 0:
        raise RuntimeError(f"llama_process returned {rc}")


def main():
    tgt_path, asst_path, ids, K, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    n = len(ids)
    C.llama_backend_init()
    mp = C.llama_model_default_params()
    mp.n_gpu_layers = 0
    tgt = C.llama_model_load_from_file(tgt_path.encode(), mp)
    asst = C.llama_model_load_from_file(asst_path.encode(), mp)
    if not tgt or not asst:
        raise RuntimeError("model load failed")
    V = C.llama_vocab_n_tokens(C.llama_model_get_vocab(tgt))
    Ht = C.llama_model_n_embd(tgt)
    ctx_t = context(tgt)
    _set_nextn(ctx_t, True, False)
    # The assistant's KV cache shares the target's cells and resizes (clears) them when it is made: attach it
    # before the target decodes anything (as llama.cpp's speculative setup does).
    ctx_a = context(asst, other=ctx_t)
    _set_nextn(ctx_a, True, True)
    decode(ctx_t, [(t, i, None, True) for i, t in enumerate(ids[:n - 1])])
    t_logits = np.stack([np.ctypeslib.as_array(C.llama_get_logits_ith(ctx_t, i), (V,)).copy() for i in range(n - 1)])
    h = np.ctypeslib.as_array(_get_nextn_ith(ctx_t, n - 2), (Ht,)).copy()
    tok, logits, hs, toks = ids[n - 1], [], [], []
    for _ in range(K):
        decode(ctx_a, [(tok, n - 1, h, True)])
        lg = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx_a, 0), (V,)).copy()
        h = np.ctypeslib.as_array(_get_nextn_ith(ctx_a, 0), (Ht,)).copy()
        logits.append(lg)
        hs.append(h)
        tok = int(np.argmax(lg))
        toks.append(tok)
    np.save(out + "_target_logits.npy", t_logits.astype(np.float32))
    np.save(out + "_draft_logits.npy", np.stack(logits).astype(np.float32))
    np.save(out + "_draft_h.npy", np.stack(hs).astype(np.float32))
    print("RESULT " + json.dumps({"tokens": toks, "n_vocab": V, "n_embd_target": Ht}))
    C.llama_free(ctx_a)
    C.llama_free(ctx_t)


if __name__ == "__main__":
    main()
