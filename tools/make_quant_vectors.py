#!/usr/bin/env python3
"""Make test vectors for Pulsar's block dequantizers from gguf-py's decoders.

For each GGML block type, random blocks are made (random bytes for the
packed quants and the 6-bit scale tables, sane f16 super-scales drawn in
[-0.1, 0.1]) and decoded with ``gguf.quants.dequantize``, the Python decoder
of the llama.cpp project. Written to ``tests/data/quant_vectors/``:

* ``<TYPE>.bin``  the raw blocks, back to back
* ``<TYPE>.f32``  the decoded values, raw little-endian float32

The first two blocks of each type have every quant byte 0x00 and 0xFF (with
random scales), the rest are fully random. A few scales are f16 subnormals.

Regenerate (numpy and gguf, in a throwaway virtualenv)::

    python3 -m venv /tmp/fixvenv && /tmp/fixvenv/bin/pip install numpy gguf
    /tmp/fixvenv/bin/python tools/make_quant_vectors.py

The output is deterministic (fixed seed).
"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "quant_vectors"

BLOCKS = 40

# Per type: (bytes per block, byte offsets of its f16 scales).
LAYOUTS = {
    "Q8_0": (T.Q8_0, 34, [0]),
    "Q4_0": (T.Q4_0, 18, [0]),
    "Q5_0": (T.Q5_0, 22, [0]),
    "Q4_K": (T.Q4_K, 144, [0, 2]),
    "Q5_K": (T.Q5_K, 176, [0, 2]),
    "Q6_K": (T.Q6_K, 210, [208]),
}


def random_scales(rng, n):
    """f16 scales in [-0.1, 0.1]; every seventh is a subnormal."""
    values = rng.uniform(-0.1, 0.1, size=n)
    tiny = rng.uniform(-6e-5, 6e-5, size=n)
    values = np.where(np.arange(n) % 7 == 3, tiny, values)
    return values.astype(np.float16)


def make(name, rng):
    qtype, block_bytes, scale_offsets = LAYOUTS[name]
    blocks = rng.integers(0, 256, size=(BLOCKS, block_bytes), dtype=np.uint8)
    blocks[0, :] = 0x00
    blocks[1, :] = 0xFF
    for at in scale_offsets:
        scales = random_scales(rng, BLOCKS)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(BLOCKS, 2)
    values = dequantize(blocks, qtype).astype(np.float32).reshape(-1)
    assert values.size == BLOCKS * (32 if name.endswith("_0") else 256)
    assert np.isfinite(values).all()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.bin").write_bytes(blocks.tobytes())
    (OUT / f"{name}.f32").write_bytes(values.astype("<f4").tobytes())
    print(f"{name}: {BLOCKS} blocks, {values.size} values, max |x| {np.abs(values).max():.4f}")


def main():
    rng = np.random.default_rng(20240607)
    for name in LAYOUTS:
        make(name, rng)


if __name__ == "__main__":
    main()
