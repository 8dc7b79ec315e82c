"""What the random-weight shape writers (make_gemma4_shape_gguf.py, make_gemma3n_shape_gguf.py) share:
random quantized rows in GGUF's block types, and a vocabulary's `tokenizer.*` keys copied from a GGUF."""
import gguf
import numpy as np

# Bytes per block and values per block of each type written.
BLOCK = {'q8_0': (34, 32), 'q4_0': (18, 32), 'q5_0': (22, 32), 'q4_k': (144, 256),
         'q6_k': (210, 256)}
GGML = {'q8_0': gguf.GGMLQuantizationType.Q8_0, 'q4_0': gguf.GGMLQuantizationType.Q4_0,
        'q5_0': gguf.GGMLQuantizationType.Q5_0, 'q4_k': gguf.GGMLQuantizationType.Q4_K,
        'q6_k': gguf.GGMLQuantizationType.Q6_K}


def f16_bytes(x):
    return np.frombuffer(np.float16(x).tobytes(), dtype=np.uint8)


def blocks(kind, rows, cols, rng):
    """Random quantized rows (values of std about 0.02) as the bytes of `kind`."""
    size, per = BLOCK[kind]
    nb = cols // per
    if kind in ('q4_k', 'q6_k', 'q5_0'):
        out = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
        if kind == 'q4_k':
            # d, dmin, then 12 bytes of 6-bit scales and mins (random), 128 of nibbles.
            out[:, :, 0:2] = f16_bytes(0.02 * np.sqrt(3) / (32 * 8))
            out[:, :, 2:4] = f16_bytes(0.02 * np.sqrt(3) / (32 * 8) * 8)
        elif kind == 'q6_k':
            # 128 bytes of low nibbles, 64 of high bits, 16 int8 scales, then d.
            out[:, :, 192:208] = rng.integers(1, 64, size=(rows, nb, 16), dtype=np.uint8)
            out[:, :, 208:210] = f16_bytes(0.02 * np.sqrt(3) / (32 * 32))
        else:
            out[:, :, 0:2] = f16_bytes(0.02 * np.sqrt(3) / 16)
        return out.reshape(rows, nb * size)
    if kind == 'q8_0':
        out = np.empty((rows, nb, 34), dtype=np.uint8)
        d = np.float16(0.02 * np.sqrt(3) / 127)
        out[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        out[:, :, 2:] = rng.integers(0, 256, size=(rows, nb, 32), dtype=np.uint8)
    else:
        out = np.empty((rows, nb, 18), dtype=np.uint8)
        d = np.float16(0.02 * np.sqrt(3) / 8)
        out[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        out[:, :, 2:] = rng.integers(0, 256, size=(rows, nb, 16), dtype=np.uint8)
    return out.reshape(rows, nb * out.shape[2])


def copy_tokenizer(w, vocab_file, pad_to=None):
    """`vocab_file`'s `tokenizer.*` keys into writer `w`; with `pad_to`, its three per-piece arrays
    padded to that many pieces (unused `[PADn]` tokens), as llama.cpp's converter pads a vocabulary."""
    vocab = gguf.GGUFReader(vocab_file)
    for field in vocab.fields.values():
        if not field.name.startswith('tokenizer.'):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                items = [bytes(field.parts[i]).decode('utf-8', 'surrogateescape')
                         for i in field.data]
            else:
                items = [field.parts[i].tolist()[0] for i in field.data]
            pad = range(len(items), pad_to or len(items))
            if field.name == 'tokenizer.ggml.tokens':
                items += [f'[PAD{i}]' for i in pad]
            elif field.name == 'tokenizer.ggml.scores':
                items += [-10000.0 for _ in pad]
            elif field.name == 'tokenizer.ggml.token_type':
                items += [int(gguf.TokenType.UNUSED) for _ in pad]
            w.add_array(field.name, items)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(field.name, bytes(field.parts[field.data[0]]).decode('utf-8'))
        else:
            w.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], kind)
