"""Helpers of the tests that launch training processes (torchrun, --nproc): the tiny run's arguments, the
environment and the comparisons of two runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import qkv
from qkv.io.files import load_safetensors

SRC = str(Path(qkv.__file__).resolve().parents[1])  # the qkv under test, also in the launched processes
STEPS = 20
ARGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--dropout", "0", "--block-size", "32",
        "--eval-interval", "5", "--eval-tokens", "300", "--sample-tokens", "0", "--device", "cpu",
        "--max-steps", str(STEPS)]  # fmt: skip
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "qkv", "train"]
QKV_TRAIN = [sys.executable, "-m", "qkv", "train"]
Finished = subprocess.CompletedProcess[str]


def dist_env(**extra: str) -> dict[str, str]:
    """The environment of every subprocess: this qkv, one thread per process (two cores, shared)."""
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}  # fmt: skip


def run_command(command: list[str], cwd: Path, **env: str) -> Finished:
    """Run a command to completion, with a generous timeout that turns a hang into a failure."""
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=dist_env(**env), timeout=240)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as dicts."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def max_diff(a: Path, b: Path, keys: tuple[str, ...] = ("train_loss", "val_loss")) -> float:
    """The largest difference of the logged losses of two runs, which must log the same steps."""
    rows_a, rows_b = rows(a), rows(b)
    assert [(r["step"], r["tokens_seen"]) for r in rows_a] == [(r["step"], r["tokens_seen"]) for r in rows_b]
    return max(abs(ra[k] - rb[k]) for ra, rb in zip(rows_a, rows_b, strict=True) for k in keys)


def weights_diff(a: Path, b: Path) -> float:
    """The largest difference between the latest weights of two runs."""
    wa, wb = load_safetensors(a / "last.safetensors"), load_safetensors(b / "last.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def excerpt(root: Path) -> Path:
    """A 20,000-character text of the embedded corpus in `root`: 18,000 train / 2,000 val characters."""
    from qkv.data import load_shakespeare

    path = root / "excerpt.txt"
    path.write_text(load_shakespeare()[:20_000], encoding="utf-8")
    return path


def one_and_two(args: list[str], cwd: Path) -> tuple[Path, Path]:
    """`qkv train ARGS` on one process with batch 4 and on 2 gloo processes with batch 2 each (the same global batch);
    their run directories, both runs checked to have ended well."""
    runs = (cwd / "one", cwd / "two")
    for out, extra in zip(runs, (["--batch-size", "4"], ["--batch-size", "2", "--nproc", "2"]), strict=True):
        done = run_command([*QKV_TRAIN, *args, *extra, "--out-dir", str(out)], cwd)
        assert done.returncode == 0, done.stderr
    return runs
