#!/usr/bin/env python3
"""Writes an F16 GGUF holding the dequantized values of a quantized GGUF.

Each quantized tensor is dequantized with gguf-py and stored as F16; F32
tensors (the norms) stay F32; every metadata key is copied, the file type
set to F16. llama.cpp then scores the very values of the quantized file
without its quantized kernels, as `pulsar ... --dtype f16` does, so the
two engines' quantization losses can be set side by side:

    G=~/.cache/pulsar-peers/llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py
    python3 -m venv /tmp/ggvenv && /tmp/ggvenv/bin/pip install numpy pyyaml
    PYTHONPATH=$G /tmp/ggvenv/bin/python tools/dequantize_gguf_f16.py \\
        ~/.cache/pulsar/gemma-3-270m-q4_k_m.gguf /tmp/g270m-f16.gguf

(gguf-py is the copy in the llama.cpp source that
../shared/tools/build-llama-cpp unpacks.)
"""

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

# llama_ftype's MOSTLY_F16.
FILE_TYPE_F16 = 1


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: dequantize_gguf_f16.py QUANTIZED.gguf OUT-F16.gguf")
    src, dst = sys.argv[1], sys.argv[2]
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        # The header's own fields are written by the writer; the file type
        # changes.
        if field.name.startswith("GGUF.") or field.name in (
            "general.architecture",
            "general.file_type",
        ):
            continue
        vtype = field.types[0]
        item_type = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, item_type)
    writer.add_file_type(FILE_TYPE_F16)
    for t in reader.tensors:
        # GGUF lists dimensions innermost first; numpy wants rows first.
        shape = [int(d) for d in reversed(t.shape.tolist())]
        if t.tensor_type == GGMLQuantizationType.F32:
            values = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float16)
        writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
