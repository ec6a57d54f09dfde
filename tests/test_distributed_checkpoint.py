"""Sharded checkpoints, compile and launch layouts across processes: 2 gloo processes on the CPU.

The tiny run of test_distributed.py (dropout 0, 20 steps, an evaluation and a checkpoint every 5). References,
shared by the tests: one process with batch 8 (in-process), and 2 DDP processes with batch 4 (torchrun).
- A kill during a save, after every rank wrote its part and before the commit, leaves the previous
  checkpoint the one that resumes; the run then ends as an uninterrupted one.
- A checkpoint of 1 process resumes on 2 (test_distributed: 2 on 1) with an uninterrupted run's losses.
- Asynchronous saves give the synchronous ones' checkpoints, tensor for tensor.
- Two nodes of one process each (torchrun's c10d rendezvous on one machine) train as one node of two.
- Under DDP and FSDP, per-layer compiled training takes eager's steps (to 1e-4), and really compiles.
- An FSDP run whose training state is larger than any process's peak memory saves and resumes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_dir, config, one_thread, read_dcp
from launching import (
    ARGS,
    QKV_TRAIN,
    STEPS,
    TORCHRUN,
    dist_env,
    excerpt,
    max_diff,
    rows,
    run_command,
    weights_diff,
)

from qkv.io.files import load_safetensors
from qkv.tasks import train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 20,000-character text: 18,000 train / 2,000 val characters."""
    return excerpt(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """One process, batch 8, through the command line (as the resumed runs are)."""
    out = tmp_path_factory.mktemp("single") / "run"
    done = run_command([*QKV_TRAIN, "--data", str(corpus), *ARGS, "--batch-size", "8", "--out-dir", str(out)],
                       out.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """Two DDP processes under torchrun, batch 4 each."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    done = run_command([*TORCHRUN, "--data", str(corpus), *ARGS, "--batch-size", "4", "--out-dir", str(out)],
                       out.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


def _pointer(run: Path) -> int:
    """The step of the run's committed checkpoint."""
    return int(json.loads((run / "checkpoint" / "latest.json").read_text())["step"])


def test_a_kill_during_a_two_process_save_falls_back_to_the_previous_checkpoint(
    tmp_path: Path, corpus: Path, ddp: Path
) -> None:
    """FSDP, rank 0 killed in step 15's save after both ranks wrote their shards: step 10 resumes, the run ends as
    DDP's uninterrupted one (to 1e-4: FSDP sums in another order), and the leftover is cleared."""
    run = tmp_path / "run"
    command = [*QKV_TRAIN, "--nproc", "2", "--strategy", "fsdp", "--data", str(corpus), *ARGS, "--batch-size", "4"]
    killed = run_command([*command, "--out-dir", str(run)], tmp_path, QKV_TEST_CRASH_AT="0:save:15")
    assert killed.returncode == 2, killed.stderr
    assert _pointer(run) == 10
    left = run / "checkpoint" / "step-00000015"
    assert (left / ".metadata").is_file() and len(list(left.glob("__*_0.distcp"))) == 2  # written, never named
    resumed = run_command([*QKV_TRAIN, "--nproc", "2", "--resume", "--out-dir", str(run)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in rows(run)] == [5, 10, 15, 20]
    assert max_diff(run, ddp) < 1e-4 and weights_diff(run, ddp) < 1e-4
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest.json", "step-00000020"]


def test_a_one_process_checkpoint_resumes_on_two_processes(tmp_path: Path, corpus: Path, single: Path) -> None:
    """1 process (batch 8) killed at step 13 continues from step 10 on 2 DDP processes of 4: the losses of steps
    15 and 20 are the uninterrupted one-process run's, to 1e-5."""
    run = tmp_path / "run"
    command = [*QKV_TRAIN, "--data", str(corpus), *ARGS, "--batch-size", "8", "--out-dir", str(run)]
    assert run_command(command, tmp_path, QKV_TEST_CRASH_AT="0:13").returncode == 1
    assert _pointer(run) == 10
    resumed = run_command([*TORCHRUN, "--resume", "--out-dir", str(run)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "2 processes (ddp), global batch 8" in resumed.stderr  # the run's global batch, split in two
    assert max_diff(run, single) < 1e-5 and weights_diff(run, single) < 1e-5


def test_asynchronous_checkpoints_equal_synchronous_ones(tmp_path: Path, corpus: Path, ddp: Path) -> None:
    """--async-checkpoint (a background thread on a gloo group of its own): the same final checkpoint, exactly."""
    run = tmp_path / "run"
    done = run_command([*TORCHRUN, "--data", str(corpus), *ARGS, "--batch-size", "4", "--async-checkpoint",
                        "--out-dir", str(run)], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _pointer(run) == STEPS and max_diff(run, ddp) == 0 and weights_diff(run, ddp) == 0
    got, want = read_dcp(checkpoint_dir(run)), read_dcp(checkpoint_dir(ddp))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes_on_one_machine_equal_two_processes_on_one_node(tmp_path: Path, corpus: Path, ddp: Path) -> None:
    """torchrun --nnodes 2 (c10d rendezvous on 127.0.0.1), one process per node, equals torchrun --nproc_per_node 2."""
    run = tmp_path / "run"
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "qkv-two-nodes",
            "-m", "qkv", "train", "--data", str(corpus), *ARGS, "--batch-size", "4", "--out-dir", str(run)]  # fmt: skip
    nodes = [subprocess.Popen(node, cwd=tmp_path, env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=240) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs
    assert sum("2 processes (ddp), global batch 8" in err for _, err in outputs) == 1  # one rank 0, on one node
    assert max_diff(run, ddp) < 1e-6 and weights_diff(run, ddp) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_training_equals_eager_under_several_processes(tmp_path: Path, corpus: Path, strategy: str) -> None:
    """5 steps, each evaluated: --compile's losses are eager's to 1e-4, and inductor really generated kernels
    (fullgraph per layer: a graph break would have stopped the run, not fallen back to eager)."""
    args = [*QKV_TRAIN, "--nproc", "2", "--strategy", strategy, "--data", str(corpus), *ARGS, "--batch-size", "4",
            "--max-steps", "5", "--eval-interval", "1"]  # fmt: skip
    cache = tmp_path / "inductor"
    runs = {}
    for mode in ("eager", "compiled"):
        runs[mode] = tmp_path / mode
        extra = ["--compile"] if mode == "compiled" else []
        done = run_command([*args, *extra, "--out-dir", str(runs[mode])], tmp_path, TORCHINDUCTOR_CACHE_DIR=str(cache))
        assert done.returncode == 0, done.stderr
    assert [r["step"] for r in rows(runs["compiled"])] == [1, 2, 3, 4, 5]
    assert max_diff(runs["eager"], runs["compiled"]) < 1e-4
    assert list(cache.rglob("*.py")), "no inductor code was generated"


MIB = 1 << 20
BIG = ["--n-layers", "12", "--d-model", "1024", "--n-heads", "8", "--dropout", "0", "--block-size", "32",
       "--batch-size", "1", "--optimizer", "adamw", "--eval-interval", "2", "--eval-tokens", "64",
       "--final-eval-tokens", "64", "--sample-tokens", "0", "--device", "cpu"]  # fmt: skip
# Runs a command and prints the peak resident memory of its largest descendant (torchrun's workers), in KiB.
PEAK_RSS = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")  # fmt: skip


@pytest.mark.slow
def test_an_fsdp_run_larger_than_any_process_saves_and_resumes(tmp_path: Path, corpus: Path) -> None:
    """A 12 × 1024 model (129 M parameters) with AdamW: weights, gradients and two moments in float32 are
    1.9 GiB; neither of 2 FSDP processes ever peaks at that much memory, though each holds half of it, while
    training, saving (its shards, the exports gathered one tensor at a time) and resuming."""
    run = tmp_path / "run"
    peaks = []
    for argv in (["--data", str(corpus), *BIG, "--max-steps", "2"], ["--resume", "--max-steps", "3"]):
        command = [sys.executable, "-c", PEAK_RSS, *QKV_TRAIN, "--nproc", "2", "--strategy", "fsdp", *argv,
                   "--out-dir", str(run)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=dist_env(), timeout=900)
        assert done.returncode == 0, done.stderr
        peaks.append(int(done.stdout.strip().splitlines()[-1]) * 1024)
    n_params = sum(t.numel() for t in load_safetensors(run / "last.safetensors").values())
    state = 4 * 4 * n_params  # float32 weights, gradients, exp_avg and exp_avg_sq
    assert state > 1900 * MIB
    print(f"peak RSS {[p // MIB for p in peaks]} MiB, training state {state // MIB} MiB")
    assert max(peaks) < state, f"peak {max(peaks) / MIB:.0f} MiB ≥ the whole state, {state / MIB:.0f} MiB"
    assert [r["step"] for r in rows(run)] == [2, 3] and _pointer(run) == 3
    shards = sorted((checkpoint_dir(run)).glob("__*_0.distcp"))
    assert len(shards) == 2  # each rank wrote its own part, about half of the weights and moments each
    assert all(p.stat().st_size < 0.55 * 3 * 4 * n_params for p in shards)
    with one_thread():
        assert train(config("lm", out_dir=str(run), resume=True, max_steps=3, device="cpu"), verbose=False).step == 3
