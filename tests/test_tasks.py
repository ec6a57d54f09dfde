"""The one training loop, task by task: every loop feature works for lm, translate, mlm, copy and reverse.

Each run is tiny (one-layer models on small data, dropout 0; translation with its default optimiser, Muon for
the blocks' matrices); translation batches are buckets of pairs of varied length, the copy and reverse
sequences have lengths 3-8, and the loss is normalised by the target positions of the whole step, across
micro-batches and processes. For every task:
- 2 micro-batches of B train exactly like one batch of 2B (weights to 1e-6 after 3 steps);
- SIGKILL, then --resume, gives weights and optimizer state bit-identical to an uninterrupted run, also
  when the kill lands in the middle of writing a checkpoint;
- 2 gloo DDP processes train like 1 process with twice the batch (weights to 1e-5);
- --compile takes the steps eager does (losses to 1e-4), as whole graphs (a graph break would raise).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    TASK_NAMES,
    checkpoint_dir,
    cli_args,
    config,
    one_thread,
    read_dcp,
    subprocess_env,
    tiny_data,
    tiny_settings,
)

from qkv.cli import main
from qkv.io.files import load_safetensors
from qkv.tasks import train
from qkv.training import TrainResult

# Run as `python -c KILLER MODE AT qkv-arguments…`: `qkv train`, SIGKILLed at a chosen point.
KILLER = """
import os, signal, sys
import qkv.training.checkpoint as checkpoint
import qkv.training.distributed as distributed
from qkv.cli import main

mode, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "step":  # between checkpoints: as step `at` begins
    distributed.crash_for_test = lambda point, ctx: die() if point == at else None
elif mode == "shards":  # mid-write: the at-th checkpoint's rank-0 state is written, its shards are not
    save, calls = checkpoint._save_side_state, []
    def side_then_die(*args):
        calls.append(1)
        save(*args)
        if len(calls) == at:
            die()
    checkpoint._save_side_state = side_then_die
elif mode == "commit":  # the at-th checkpoint is written whole, but latest.json does not name it yet
    write, pointers = checkpoint.atomic_write_json, []
    def pointer(path, obj, **kw):
        if path.name == "latest.json":
            pointers.append(path)
            if len(pointers) == at:
                die()
        write(path, obj, **kw)
    checkpoint.atomic_write_json = pointer
sys.exit(main(argv))
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The small text and pairs file every tiny run trains on."""
    return tiny_data(tmp_path_factory.mktemp("data"))


def _train(task: str, settings: dict[str, Any], out: Path, **overrides: Any) -> TrainResult:
    """A tiny run in this process, on one thread (as the subprocesses run)."""
    with one_thread():
        return train(config(task, **{**settings, **overrides, "out_dir": str(out)}), verbose=False)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The run's latest weights."""
    return load_safetensors(run_dir / "last.safetensors")


def _max_diff(a: Path, b: Path) -> float:
    """The largest difference between the latest weights of two runs."""
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def _training_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """What training continues from: weights, optimizer state, torch's RNG, the data generator, the counters.

    Python's and numpy's global RNG states are saved and restored too, but no step uses them, so their
    values at a checkpoint depend on the rest of the process (here: pytest's), not on the training.
    """
    tensors = {f"export.{k}": v for k, v in _weights(run_dir).items()}
    directory = checkpoint_dir(run_dir)
    tensors |= {f"dcp.{k}": v for k, v in read_dcp(directory).items()}  # weights and optimizer state
    saved = load_safetensors(directory / "rng.safetensors")
    tensors |= {k: v for k, v in saved.items() if not k.startswith(("rng.python", "rng.numpy"))}
    side = json.loads((directory / "state.json").read_text())
    extra = side["extra"]
    return tensors, {"groups": side["param_groups"], "step": extra["step"], "tokens_seen": extra["tokens_seen"]}


@pytest.mark.parametrize("task", TASK_NAMES)
def test_two_micro_batches_of_b_train_like_one_batch_of_2b(task: str, data: dict[str, Path], tmp_path: Path) -> None:
    settings = tiny_settings(task, data)
    b = settings["batch_size"]
    one = _train(task, settings, tmp_path / "one", batch_size=2 * b, max_steps=3)
    two = _train(task, settings, tmp_path / "two", batch_size=b, grad_accum=2, max_steps=3)
    assert [r["tokens_seen"] for r in one.metrics] == [r["tokens_seen"] for r in two.metrics]  # the same examples
    assert _max_diff(one.run_dir, two.run_dir) < 1e-6
    assert _max_diff(one.run_dir, tmp_path / "two") < 1e-6
    assert one.metrics[-1]["train_loss"] == pytest.approx(two.metrics[-1]["train_loss"], abs=1e-6)


@pytest.fixture(scope="module")
def uninterrupted(data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One uninterrupted 6-step run per task (checkpoints at steps 2, 4, 6), trained on first use."""
    runs: dict[str, Path] = {}

    class Runs(dict):  # type: ignore[type-arg]
        def __missing__(self, task: str) -> Path:
            out = tmp_path_factory.mktemp(f"uninterrupted-{task}") / "run"
            _train(task, tiny_settings(task, data), out)
            self[task] = out
            return out

    return Runs(runs)


KILLS = [(task, mode) for task in TASK_NAMES for mode in ("step", "commit")] + [("lm", "shards")]


@pytest.mark.parametrize(("task", "mode"), KILLS, ids=[f"{t}-{m}" for t, m in KILLS])
def test_sigkill_then_resume_is_bit_identical(
    task: str, mode: str, data: dict[str, Path], uninterrupted: dict[str, Path], tmp_path: Path
) -> None:
    """Killed as step 5 begins, or inside the second checkpoint's save (before its shards, or written but not yet
    committed): --resume ends as the uninterrupted run, from step 4 or from step 2."""
    out = tmp_path / "run"
    at = 5 if mode == "step" else 2  # step 5, or the second checkpoint (step 4)
    argv = ["train", task, *cli_args(tiny_settings(task, data)), "--out-dir", str(out)]
    killed = subprocess.run([sys.executable, "-c", KILLER, mode, str(at), *argv], capture_output=True, text=True,
                            env=subprocess_env(), timeout=300)  # fmt: skip
    assert killed.returncode == -9, killed.stderr  # SIGKILL: no clean-up ran
    committed = json.loads((out / "checkpoint" / "latest.json").read_text())["step"]
    assert committed == (4 if mode == "step" else 2)
    with one_thread():
        assert main(["train", task, "--resume", "--out-dir", str(out)]) == 0
    resumed, reference = _training_state(out), _training_state(uninterrupted[task])
    assert resumed[1] == reference[1]
    assert resumed[0].keys() == reference[0].keys()
    for name, tensor in reference[0].items():
        assert torch.equal(resumed[0][name], tensor), name
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp file left
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["latest.json", "step-00000006"]  # one left


@pytest.mark.parametrize("task", TASK_NAMES)
def test_two_ddp_processes_train_like_one_with_twice_the_batch(
    task: str, data: dict[str, Path], tmp_path: Path
) -> None:
    settings = tiny_settings(task, data) | {"max_steps": 3, "eval_interval": 3}
    b = settings["batch_size"]
    single = _train(task, settings, tmp_path / "single", batch_size=2 * b)
    argv = ["train", task, *cli_args(settings | {"batch_size": b}), "--nproc", "2", "--out-dir", str(tmp_path / "ddp")]
    done = subprocess.run([sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, env=subprocess_env(),
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 processes (ddp)" in done.stderr
    assert _max_diff(single.run_dir, tmp_path / "ddp") < 1e-5
    rows = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["tokens_seen"] == single.metrics[-1]["tokens_seen"]  # both saw the global batch


@pytest.mark.parametrize("task", ["translate", "mlm", "copy"])  # lm: tests/test_distributed.py; reverse is copy's
def test_fsdp_trains_every_task_like_one_process(task: str, data: dict[str, Path], tmp_path: Path) -> None:
    """--strategy fsdp shards every encoder and decoder layer; decoding (encode/decode) goes through FSDP too."""
    settings = tiny_settings(task, data) | {"max_steps": 3, "eval_interval": 3, "optimizer": "adamw"}  # Muon: refused
    b = settings["batch_size"]
    single = _train(task, settings, tmp_path / "single", batch_size=2 * b)
    argv = ["train", task, *cli_args(settings | {"batch_size": b}), "--nproc", "2", "--strategy", "fsdp",
            "--out-dir", str(tmp_path / "fsdp")]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, env=subprocess_env(),
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 processes (fsdp)" in done.stderr
    assert _max_diff(single.run_dir, tmp_path / "fsdp") < 1e-4
    rows = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val_loss"] == pytest.approx(single.metrics[-1]["val_loss"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("task", TASK_NAMES)
def test_compiled_training_matches_eager(task: str, data: dict[str, Path], tmp_path: Path) -> None:
    """--compile compiles whole graphs (fullgraph: a graph break raises) and takes eager's steps, to 1e-4."""
    from torch._dynamo.utils import counters

    settings = tiny_settings(task, data) | {"max_steps": 4}
    eager = _train(task, settings, tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = _train(task, settings, tmp_path / "compiled", compile=True)
    assert counters["stats"]["unique_graphs"] >= 1  # it really ran compiled code
    assert not counters["graph_break"]  # and nothing of the model ran eagerly instead
    for a, b in zip(eager.metrics, compiled.metrics, strict=True):
        assert a["step"] == b["step"]
        for key in ("train_loss", "val_loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-4), (a["step"], key)
