"""Activation checkpointing: the peak memory and the time of one training step's forward + backward, with and
without `--activation-checkpointing`, on a 12-layer, width-512 DecoderLM at T = 1,024.

The model is the language model's block (rotary positions, RMSNorm, SwiGLU, 8 heads) at 12 × 512, vocabulary
1,024 (small, so that the layers' activations, not the logits, are what is measured), batch --batch-size.
Peak memory is what the step allocates beyond the model, its inputs and the gradients' buffers of a first step:
- on CUDA, torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus the memory allocated by then;
- on CPU, each case runs in a forked child: the peak resident set (VmHWM) after the step minus the resident set
  just before it, with freed heap returned to the OS and the peak mark restarted first (qkv.bench.reset_peak_rss).
The gradients of the two runs are compared too (they must agree: recomputation replays dropout's random state).

    python benchmarks/activation_checkpointing.py                   # CPU, batch 2
    python benchmarks/activation_checkpointing.py --device cuda --batch-size 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

import torch

from qkv import DecoderLM
from qkv.bench import reset_peak_rss, save_report, status_bytes
from qkv.models import DecoderLMConfig
from qkv.training.recompute import checkpoint_layers

SHAPE = {"n_layers": 12, "d_model": 512, "n_heads": 8, "vocab_size": 1024, "positions": "rotary", "norm": "rms",
         "activation": "swiglu", "bias": False, "dropout": 0.0}  # fmt: skip


def measure(recompute: bool, t: int, batch: int, device: str) -> dict[str, Any]:
    """Peak extra memory (MiB), seconds of one forward + backward, and the gradients' norm."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.of(**SHAPE, max_positions=t)).to(device)
    if recompute:
        checkpoint_layers(model)
    ids = torch.randint(SHAPE["vocab_size"], (batch, t + 1), generator=torch.Generator().manual_seed(1)).to(device)

    def step() -> None:
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()

    step()  # the gradients' buffers exist from here on, as in training
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = reset_peak_rss()
    began = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    peak = (torch.cuda.max_memory_allocated() if cuda else status_bytes("VmHWM")) - base
    grad = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu().numpy()  # numpy: it pickles to the parent
    return {"peak_mib": peak / 2**20, "seconds": seconds, "grad": grad}


def _child(conn: Any, *args: Any) -> None:
    """Forked-process body: one case, sent back."""
    conn.send(measure(*args))
    conn.close()


def run(recompute: bool, t: int, batch: int, device: str) -> dict[str, Any]:
    """measure() in a forked child on CPU (a clean peak-RSS baseline), in-process on CUDA."""
    if device.startswith("cuda"):
        return measure(recompute, t, batch, device)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, recompute, t, batch, device))
    proc.start()
    child.close()
    result: dict[str, Any] = parent.recv()
    proc.join()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    plain = run(False, args.seq_len, args.batch_size, args.device)
    recomputed = run(True, args.seq_len, args.batch_size, args.device)
    diff = float(abs(plain["grad"] - recomputed["grad"]).max() / abs(plain["grad"]).max())
    shape = f"12 layers × 512, T = {args.seq_len}, batch {args.batch_size}, {args.device}"
    print(f"forward + backward of a DecoderLM, {shape}")
    print(f"{'':<28}{'peak MiB':>10}{'seconds':>10}")
    for name, r in (("plain", plain), ("activation checkpointing", recomputed)):
        print(f"{name:<28}{r['peak_mib']:>10.0f}{r['seconds']:>10.2f}")
    ratio = plain["peak_mib"] / recomputed["peak_mib"]
    print(f"memory: {ratio:.2f}× less; time: {recomputed['seconds'] / plain['seconds']:.2f}×; gradients: max "
          f"|difference| / max |gradient| = {diff:.1e}")
    report = {"shape": shape, "plain": {k: v for k, v in plain.items() if k != "grad"},
              "recomputed": {k: v for k, v in recomputed.items() if k != "grad"}, "grad_rel_diff": diff}  # fmt: skip
    save_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
