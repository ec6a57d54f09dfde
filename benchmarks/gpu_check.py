"""The stages of benchmarks/gpu_check.sh, one subcommand each: run it, check it, print `FIGURE: …` for the table.

Each stage exits non-zero when its check fails. --dry-run gives every stage tiny sizes on the CPU, so that the
whole script can be tested without a GPU (tests/test_cuda.py does).

    python benchmarks/gpu_check.py env            # torch, CUDA, the device and its bf16 matmul peak
    python benchmarks/gpu_check.py tests          # pytest -m cuda tests/test_cuda.py
    python benchmarks/gpu_check.py throughput     # GPT-2 124M's shape, bf16, torch.compile, qkv's training loop
    python benchmarks/gpu_check.py attention      # flash attention at T = 8,192 and 32,768: time, memory
    python benchmarks/gpu_check.py decode         # greedy decode tok/s against transformers
    python benchmarks/gpu_check.py fsdp           # 3 FSDP steps on a process group of one, eager and compiled
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark scripts, imported as modules

import attention as attention_bench  # noqa: E402
import decode as decode_bench  # noqa: E402
import train_throughput  # noqa: E402

from qkv.training import distributed  # noqa: E402
from qkv.training.distributed import DistContext  # noqa: E402

MFU_TARGET = 0.40  # the GPT-2-shape MFU worth having on one GPU (nanoGPT reaches about that on an A100)


def figure(text: str) -> None:
    """The line gpu_check.sh puts in its summary table."""
    print(f"FIGURE: {text}", flush=True)


def _json(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def env(dry: bool) -> int:
    """torch and CUDA versions, the device, and the bf16 matmul peak (the CPU's fp32 one in a dry run)."""
    cuda = torch.cuda.is_available()
    if not cuda and not dry:
        print("no CUDA GPU visible to torch")
        return 1
    if cuda:
        name = torch.cuda.get_device_name()
        peak = train_throughput.cuda_matmul_flops(n=1024 if dry else 8192) / 1e12
        kind = f"bf16 {1024 if dry else 8192}³ matmul, mean of 10 after 3 warm-ups"
    else:
        name = "cpu (dry run)"
        peak = train_throughput.peak_matmul_flops(n=512) / 1e12
        kind = "fp32 512³ matmul, best of 10"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name}, {torch.get_num_threads()} CPU threads")
    figure(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name}; peak {peak:.4g} TFLOP/s ({kind})")
    return 0


def _missing(*modules: str) -> str | None:
    """A one-line figure naming the first module not installed (the dev set-up installs them), or None."""
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"needs {module}, which this Python lacks: run `bash scripts/setup.sh --dev` (or set PYTHON)"
    return None


def tests(dry: bool) -> int:
    """The CUDA-marked tests; on a GPU none may skip."""
    if (missing := _missing("pytest")) is not None:
        figure(missing)
        return 1
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    lines = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as done:
        assert done.stdout is not None
        for line in done.stdout:  # as it comes: a stage stopped by its timeout still shows how far it got
            print(line, end="", flush=True)
            lines.append(line)
    summary = lines[-1] if lines else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    shown = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no tests ran"
    figure(f"pytest -m cuda tests/test_cuda.py: {shown}")
    if dry:  # no GPU: every test skips, and that is a pass
        return done.returncode
    return 0 if done.returncode == 0 and counts.get("passed") and not counts.get("skipped") else 1


def throughput(dry: bool) -> int:
    """GPT-2 124M's shape through qkv's training loop: tokens/s and MFU against the bf16 peak of the same run."""
    if dry:  # a few steps of a tiny model, bf16 autocast on the CPU, no compile (inductor's C++ build takes minutes)
        shape = ["--n-layers", "2", "--d-model", "64", "--n-heads", "2", "--n-kv-heads", "2", "--block-size", "64",
                 "--batch-size", "4", "--vocab-size", "512", "--device", "cpu", "--steps", "3",
                 "--warmup", "1"]  # fmt: skip
    else:  # GPT-2 small: multi-head attention (not the recipe's one key/value head), 50,304 entries, 1,024 positions
        shape = ["--n-layers", "12", "--d-model", "768", "--n-heads", "12", "--n-kv-heads", "12", "--block-size",
                 "1024", "--batch-size", "32", "--vocab-size", "50304", "--device", "cuda", "--compile", "--steps",
                 "15", "--warmup", "4"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "throughput.json"
        train_throughput.main([*shape, "--gpt", "--optimizer", "adamw", "--dtype", "bfloat16", "--json", str(out)])
        r = _json(out)
    b, t = r["batch_size"], r["block_size"]
    compiled = ", compiled" if r["config"]["compile"] else ""
    attention = r["config"]["model"]["decoder"]["block"]["attention"]
    heads = f"{attention['n_heads']}/{attention['n_kv_heads'] or attention['n_heads']} q/kv heads"
    figure(f"B×T = {b}×{t:,}, {r['params_m']:.1f} M params, {heads}, bf16{compiled}, AdamW: "
           f"{r['tokens_per_s']:,.0f} tok/s, {r['ms_per_step']:.1f} ms/step, {r['model_tflops_per_s']:.4g} TFLOP/s "
           f"= MFU {r['mfu']:.1%} of {r['peak_tflops_per_s']:.4g} (target {MFU_TARGET:.0%})")  # fmt: skip
    return 0 if r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 else 1


def attention(dry: bool) -> int:
    """Flash attention's time and memory at two lengths 4× apart; memory must grow ~4× (linear), not ~16×."""
    short, long = (512, 2048) if dry else (8192, 32768)
    device = "cpu" if dry else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "attention.json"
        argv = ["--seq-lens", str(short), str(long), "--paths", "fused", "reference", "--dtype", "bfloat16",
                "--kernel", "flash", "--device", device, "--repeats", "1" if dry else "5",
                "--ref-cap-mib", "4" if dry else "4096", "--json", str(out)]  # fmt: skip
        if dry:
            argv += ["--threads", "1"]
        attention_bench.main(argv)
        results = _json(out)["results"]
    fused, ref = results["fused"], results["reference"]
    if any("error" in fused[str(t)] for t in (short, long)):
        figure(f"fused path failed: {fused}")
        return 1
    ratio = fused[str(long)]["peak_mib"] / fused[str(short)]["peak_mib"]
    cases = "; ".join(f"T={t:,} {fused[str(t)]['ms']:.2f} ms {fused[str(t)]['peak_mib']:,.1f} MiB"
                      for t in (short, long))  # fmt: skip
    reference = ref[str(short)]
    shown = f"{reference['peak_mib']:,.0f} MiB" if "peak_mib" in reference else reference.get("error", "skipped")
    growth = "linear" if ratio < 6 else "NOT linear"
    figure(f"fused bf16 flash fwd+bwd (1×8 heads×64): {cases}; mem ratio {ratio:.2f}× ({growth}); "
           f"reference T={short:,}: {shown}, T={long:,} skipped")  # fmt: skip
    return 0 if ratio < 6 else 1


def decode(dry: bool) -> int:
    """Greedy decoding of GPT-2 small's shape: qkv (cache) against transformers, fp32 and bf16, batch 1."""
    if (missing := _missing("transformers")) is not None:
        figure(missing)
        return 1
    shape = ["--n-layers", "1", "--d-model", "64", "--n-heads", "2", "--vocab-size", "512", "--threads", "1",
             "--device", "cpu"] if dry else ["--device", "cuda"]  # fmt: skip
    new = "8" if dry else "64"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        decode_bench.main([*shape, "--batch-sizes", "1", "--prompt-len", "16", "--new-tokens", new,
                           "--uncached-tokens", "4" if dry else "32", "--dtypes", "float32", "bfloat16",
                           "--no-int8", "--repeats", "2", "--json", str(out)])  # fmt: skip
        r = _json(out)
    rows = r["rows"]
    fp32, bf16 = rows["float32/1"], rows["bfloat16/1"]
    figure(f"batch 1, {new} tokens: qkv fp32 {fp32['qkv_cache_tokens_per_s']:,.0f} vs HF fp32 "
           f"{fp32['transformers_tokens_per_s']:,.0f} tok/s ({fp32['qkv_over_transformers']:.2f}×); qkv bf16 "
           f"{bf16['qkv_cache_tokens_per_s']:,.0f} vs HF bf16 {bf16['transformers_tokens_per_s']:,.0f} "
           f"({bf16['qkv_over_transformers']:.2f}×); same tokens fp32 {fp32['same_tokens']}")  # fmt: skip
    return 0 if all(row["qkv_cache_tokens_per_s"] > 0 for row in rows.values()) else 1


@dataclass(frozen=True)
class GroupOfOne(DistContext):
    """One rank that still counts as distributed: the loop wraps, shards and gathers as it does with several."""

    @property
    def enabled(self) -> bool:
        """True: a process group exists (of one rank)."""
        return True


def forced_group(store: Path) -> Any:
    """A stand-in for distributed.process_group that joins an in-process group of one (nccl on CUDA, gloo on CPU)."""

    @contextlib.contextmanager
    def process_group(device: torch.device, strategy: str, timeout_s: float) -> Iterator[DistContext]:
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        groups = distributed.join_groups(backend, timeout_s, store=dist.FileStore(str(store), 1), rank=0,
                                         world_size=1)  # fmt: skip
        try:
            yield GroupOfOne(0, 1, strategy, device, *groups)
        finally:
            dist.destroy_process_group()

    return process_group


def _max_loss_gap(a: Any, b: Any) -> float:
    """The largest train or val loss difference between two runs' metrics, row by row."""
    return max(abs(x[k] - y[k]) for x, y in zip(a.metrics, b.metrics, strict=True) for k in ("train_loss", "val_loss"))


def fsdp(dry: bool) -> int:
    """3 steps with --strategy fsdp on a forced group of one, FSDP2 around a model built on the meta device.

    In float32 the sharded run must equal one process (loss and weights, to rounding). In bfloat16 the two
    differ by design: FSDP's MixedPrecisionPolicy gathers bf16 parameters and reduces bf16-computed gradients,
    where one process autocasts each op from fp32 weights, so only the losses are compared, to bf16's
    precision; on the GPU the bf16 run is repeated with --compile (per-layer graphs, the criterion's graph).

    torchrun --nproc_per_node 1 would not do: with WORLD_SIZE 1 the loop takes its one-process path and never
    shards. Here the loop's process_group is swapped for one that joins a real (nccl) group of one rank.
    """
    from torch.distributed.fsdp import FSDPModule

    from qkv.tasks import load, recipe, train
    from qkv.training import meta_init

    device = "cpu" if dry else "cuda"
    model = {"n_layers": 2, "d_model": 64, "n_heads": 4, "dropout": 0.0}  # over the default recipe's model
    settings: dict[str, Any] = {"model": model, "block_size": 64, "batch_size": 8, "max_steps": 3,
                                "eval_interval": 1, "eval_tokens": 1024, "final_eval_tokens": 1024,
                                "sample_tokens": 0, "warmup_steps": 1, "device": device}  # fmt: skip
    wrapped: list[torch.nn.Module] = []
    materialised: list[torch.device] = []

    def wrap_model(model: torch.nn.Module, ctx: DistContext, dtype: str = "float32") -> torch.nn.Module:
        wrapped.append(real_wrap(model, ctx, dtype))
        return wrapped[-1]

    def materialise(model: torch.nn.Module, plan: Any, device: torch.device) -> None:
        materialised.append(device)
        real_materialise(model, plan, device)

    real_wrap, real_materialise = distributed.wrap_model, meta_init.materialise
    sharded_runs = [("float32", False), ("bfloat16", False)] + ([] if dry else [("bfloat16", True)])
    with tempfile.TemporaryDirectory() as tmp:

        def run(name: str, **kw: Any) -> Any:
            return train(recipe("lm", {**settings, **kw, "out_dir": f"{tmp}/{name}"}), verbose=False)

        single = {dtype: run(f"single-{dtype}", dtype=dtype) for dtype in ("float32", "bfloat16")}
        with mock.patch.object(distributed, "process_group", forced_group(Path(tmp) / "store")), \
                mock.patch.object(distributed, "wrap_model", wrap_model), \
                mock.patch.object(meta_init, "materialise", materialise):  # fmt: skip
            runs = {(dtype, c): run(f"fsdp-{dtype}-{c}", dtype=dtype, strategy="fsdp", compile=c)
                    for dtype, c in sharded_runs}  # fmt: skip
        gap32, gap16 = (_max_loss_gap(single[d], runs[d, False]) for d in ("float32", "bfloat16"))
        compiled = runs.get(("bfloat16", True))
        c_gap = 0.0 if compiled is None else _max_loss_gap(compiled, runs["bfloat16", False])
        loaded = load(f"{tmp}/fsdp-float32-False", checkpoint="last", device=device)
        weights = load(f"{tmp}/single-float32", checkpoint="last", device=device).model.state_dict()
        w_gap = max(float((v - weights[k]).abs().max()) for k, v in loaded.model.state_dict().items())
        text = loaded.generate("ROMEO:", max_new_tokens=8, seed=0)
    sharded = all(isinstance(m, FSDPModule) for m in wrapped)  # fully_shard swaps the class in place
    on_meta = len(materialised) == len(runs) and all(d.type == device for d in materialised)
    compiled_text = "" if compiled is None else f"; bf16 --compile vs eager max Δloss {c_gap:.1e}"
    figure(f"3 steps, FSDP2 {'wrapped' if sharded else 'NOT wrapped'} on 1 rank ({'gloo' if dry else 'nccl'}, "
           f"{device}), {'built on meta' if on_meta else 'NOT built on meta'}; vs 1 process: fp32 max Δloss "
           f"{gap32:.1e}, max Δweight {w_gap:.1e}; bf16 max Δloss {gap16:.1e}{compiled_text}; checkpoint loads "
           f"and samples {len(text)} chars")  # fmt: skip
    ok = sharded and len(wrapped) == len(runs) and on_meta and len(text) == 8
    return 0 if ok and gap32 < 1e-4 and w_gap < 1e-3 and gap16 < 2e-2 and c_gap < 2e-2 else 1


STAGES = {"env": env, "tests": tests, "throughput": throughput, "attention": attention, "decode": decode,
          "fsdp": fsdp}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run one stage."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=list(STAGES))
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    args = p.parse_args(argv)
    return STAGES[args.stage](args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
