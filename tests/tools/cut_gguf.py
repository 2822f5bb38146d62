"""Cut a llama-family GGUF file to its first N decoder layers (for a GPU machine reached through a size-limited
transfer: the embedded SmolLM2 is 98 MB, its 3-layer cut ~20 MB).

    python tests/tools/cut_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf cut.gguf --layers 3

Every metadata field is copied except ``<arch>.block_count``, which becomes N; tensors of layers >= N are left out.
The cut is a valid model of its own (same tokenizer, embeddings and head), so the CPU and GPU paths can be
compared on it (tests/native/test_cuda_gguf.py reads it through CANDLE_VLLM_TEST_GGUF).
"""

from __future__ import annotations

import argparse
import re

import gguf


def cut(src: str, dst: str, layers: int) -> int:
    """Writes the cut to ``dst``; returns how many tensors it holds."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(dst, arch)
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return len(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    print(f"{cut(args.src, args.dst, args.layers)} tensors written to {args.dst}")


if __name__ == "__main__":
    main()
