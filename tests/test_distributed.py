"""Tests for data-parallel (DDP) and sharded (FSDP) training: 2 gloo processes on the CPU.

Every run is the tiny model of test_training.py with dropout 0 (so that 2 ranks × B and 1 rank × 2B
take bit-for-bit the same rows and the only differences are float summation order), 20 steps, an
evaluation every 5 steps over the first 300 validation tokens. Three reference runs are shared by the
tests: one process with batch 8 (in-process), 2 DDP processes with batch 4 (torchrun), and 2 FSDP
processes with batch 4 (the `--nproc 2` shortcut).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import config, model_cfg, one_thread, shard_dir
from launching import ARGS, QKV_TRAIN, STEPS, TORCHRUN, Finished, excerpt
from launching import max_diff as _max_diff
from launching import rows as _rows
from launching import run_command as _run
from launching import weights_diff as _weights_diff

from qkv.data.cache import open_text
from qkv.errors import QkvError
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.tasks import load, train
from qkv.tasks.lm import LMConfig
from qkv.training import evaluate_loss, evaluate_sums
from qkv.training.distributed import (
    DistContext,
    any_rank,
    gradient_sync,
    join_groups,
    sum_over_ranks,
    wrap_model,
)


def _config(corpus: Path, out: Path, batch_size: int, **overrides: Any) -> LMConfig:
    """The in-process twin of `qkv train --data CORPUS ARGS --batch-size B --out-dir OUT`."""
    model = {"n_layers": 1, "d_model": 32, "n_heads": 2, "dropout": 0.0}  # over the recipe's model
    settings: dict[str, Any] = {"data": str(corpus), "model": model, "block_size": 32, "batch_size": batch_size,
                                "eval_interval": 5, "eval_tokens": 300, "sample_tokens": 0, "device": "cpu",
                                "max_steps": STEPS, "out_dir": str(out)}  # fmt: skip
    return config("lm", **{**settings, **overrides})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 20,000-character text: 18,000 train / 2,000 val characters."""
    return excerpt(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """One process, batch 8."""
    out = tmp_path_factory.mktemp("single") / "run"
    with one_thread():
        train(_config(corpus, out, 8), verbose=False)
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[Path, str]:
    """Two DDP processes under torchrun, batch 4 each: (run dir, stderr)."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    done = _run([*TORCHRUN, "--data", str(corpus), *ARGS, "--batch-size", "4", "--out-dir", str(out)], out.parent)
    assert done.returncode == 0, done.stderr
    return out, done.stderr


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[Path, Finished, float]:
    """Two FSDP processes via the `--nproc 2` shortcut, batch 4 each, rank 1 dying at step 13 (checkpoint: 10).

    Returns (run dir, the finished command, its wall-clock seconds).
    """
    out = tmp_path_factory.mktemp("crashed") / "run"
    command = [*QKV_TRAIN, "--nproc", "2", "--strategy", "fsdp", "--data", str(corpus), *ARGS, "--batch-size", "4"]
    start = time.monotonic()
    done = _run([*command, "--out-dir", str(out)], out.parent, QKV_TEST_CRASH_AT="1:13")
    return out, done, time.monotonic() - start


def test_two_ddp_processes_equal_one_process_with_twice_the_batch(single: Path, ddp: tuple[Path, str]) -> None:
    """Same rows, so the same losses and final weights (to float summation order); only rank 0 logs."""
    run, stderr = ddp
    assert [r["step"] for r in _rows(run)] == [5, 10, 15, 20]
    assert _rows(run)[-1]["tokens_seen"] == STEPS * 8 * 32  # the global batch: 2 ranks × 4
    assert _max_diff(single, run) < 1e-5
    assert _weights_diff(single, run) < 1e-5
    assert len(re.findall(r"^step +20 ", stderr, flags=re.M)) == 1  # one log, from rank 0
    assert "2 processes (ddp), global batch 8" in stderr
    # The sharded validation loss (the last one reads the whole split) equals the one-process protocol on the
    # same weights, bit for bit.
    trained = load(run, "last")
    val = open_text(trained.config.source, trained.tokenizer).split("val")
    assert evaluate_loss(trained.model, val, 32, 4) == _rows(run)[-1]["val_loss"]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    sums = evaluate_sums(trained.model, val, 32, 4, token_bytes=torch.tensor(trained.require_tokenizer().token_bytes()))
    assert (sums.mean, sums.bits_per_byte()) == (last["val_loss"], last["val_bpb"])  # bits per byte's sums too
    assert [r["full_eval"] for r in _rows(run)] == [False, False, False, True]


def test_two_ddp_processes_on_shards_equal_one_process_with_twice_the_batch(tmp_path: Path) -> None:
    """The same on a data directory of several shards (random windows drawn across them): 2 gloo ranks × 4 = 1 × 8."""
    data = shard_dir(tmp_path)
    single_run, ddp_run = tmp_path / "single", tmp_path / "ddp"
    with one_thread():
        train(_config(data, single_run, 8), verbose=False)
    done = _run([*TORCHRUN, "--data", str(data), *ARGS, "--batch-size", "4", "--out-dir", str(ddp_run)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert _rows(ddp_run)[-1]["tokens_seen"] == STEPS * 8 * 32
    assert _max_diff(single_run, ddp_run) < 1e-5
    assert _weights_diff(single_run, ddp_run) < 1e-5


def test_a_dead_rank_stops_the_run_quickly_with_one_line(
    crashed: tuple[Path, Finished, float],
) -> None:
    """Rank 1 exits at step 13: the launcher stops rank 0 too, and `--nproc` ends with one error line, exit 2."""
    run, done, took = crashed
    assert done.returncode == 2, done.stderr
    assert took < 90, f"a dead rank took {took:.0f} s to stop the run"
    last = done.stderr.strip().splitlines()[-1]
    # The launcher names the first failure it sees: usually rank 1 (exit code 1), but rank 0's gloo
    # thread may abort first when its peer's sockets close. Either way: one line, and how to resume.
    pattern = r"qkv train: error: training process rank [01] failed \((exit code 1|signal SIGABRT)\b.*--resume.*"
    assert re.fullmatch(pattern, last), last
    assert "Traceback" not in done.stderr
    assert [r["step"] for r in _rows(run)] == [5, 10]  # the checkpoint of step 10 survived


def test_one_process_resumes_a_two_process_checkpoint(
    tmp_path: Path, crashed: tuple[Path, Finished, float], ddp: tuple[Path, str]
) -> None:
    """A different world size: 1 process takes the run's global batch of 8 and continues from step 10.

    Steps 1-10 ran under FSDP, 11-20 in one process; the uninterrupted reference is the DDP run.
    """
    run = tmp_path / "run"
    shutil.copytree(crashed[0], run)
    with one_thread():
        result = train(config("lm", out_dir=str(run), resume=True, max_steps=STEPS, device="cpu"), verbose=False)
    assert result.step == STEPS
    assert _max_diff(run, ddp[0]) < 1e-5
    assert _weights_diff(run, ddp[0]) < 1e-5


def test_fsdp_resumes_and_matches_ddp_and_its_checkpoint_loads_in_one_process(
    tmp_path: Path, crashed: tuple[Path, Finished, float], ddp: tuple[Path, str]
) -> None:
    """torchrun + FSDP continues the crashed FSDP run: 20 FSDP steps track DDP's; the result loads and generates."""
    run = tmp_path / "run"
    shutil.copytree(crashed[0], run)
    command = [*TORCHRUN, "--resume", "--out-dir", str(run), "--strategy", "fsdp", "--device", "cpu"]
    done = _run([*command, "--sample-tokens", "0"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^step +(\d+) ", done.stderr, flags=re.M) == ["15", "20"]  # continued, once
    assert _max_diff(run, ddp[0]) < 1e-4
    assert _weights_diff(run, ddp[0]) < 1e-4
    trained = load(run)  # the best weights, gathered from the shards and written by rank 0
    text = trained.generate("ROMEO:", max_new_tokens=20, seed=0)
    assert len(text) == 20


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[None]:
    """An in-process gloo process group of one rank (enough to build DDP / FSDP modules and count their syncs)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_loops_per_step_collectives_get_host_groups_of_their_own(tmp_path: Path) -> None:
    """join_groups: the checkpoint and control groups are gloo groups beside the default one, so the loop's
    per-step counts and stop flags (CPU tensors) never go through nccl, which cannot take them."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    side, control = join_groups("gloo", 60, store=store, rank=0, world_size=1)
    try:
        assert side is not control and dist.group.WORLD not in (side, control)
        assert dist.get_backend(side) == dist.get_backend(control) == "gloo"
        ctx = DistContext(0, 2, "ddp", torch.device("cpu"), side, control)  # "of 2": the collectives run
        assert any_rank(True, ctx) and not any_rank(False, ctx)
        assert sum_over_ranks([7, 3], ctx) == [7, 3]
    finally:
        dist.destroy_process_group()


def _accumulate(model: torch.nn.Module, micro_batches: int) -> None:
    """Forward + backward of `micro_batches` micro-batches, syncing gradients only in the last, as the trainer does."""
    for micro in range(micro_batches):
        with gradient_sync(model, micro == micro_batches - 1):
            x = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(micro))
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gradient_accumulation_syncs_once_per_step(group_of_one: None, strategy: str) -> None:
    """3 micro-batches, 1 gradient sync: DDP's all-reduce runs in the last backward only (FSDP: its sync flag)."""
    torch.manual_seed(0)
    lm = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=11, n_layers=1, d_model=16, n_heads=2,
                             max_positions=8, dropout=0.0))
    model = wrap_model(lm, DistContext(0, 2, strategy, torch.device("cpu")))  # as rank 0 of 2 would wrap it
    synced: list[bool] = []
    if strategy == "ddp":
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)

        # No annotation on `bucket`: DDP rejects any but the real dist.GradBucket class (here it would be a string).
        def count(state: Any, bucket):  # type: ignore[no-untyped-def]
            synced.append(True)
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        model.register_comm_hook(None, count)
        _accumulate(model, 3)
        assert len(synced) == 1  # one bucket (a tiny model), all-reduced once
    else:
        real = model.set_requires_gradient_sync  # type: ignore[operator]
        model.set_requires_gradient_sync = lambda on, **kw: (synced.append(on), real(on, **kw))  # type: ignore
        _accumulate(model, 3)
        assert synced == [False, True, False, True]  # off for micro-batches 1 and 2, back on for the last


def test_torchrun_without_out_dir_agrees_on_one_run_directory(tmp_path: Path, corpus: Path) -> None:
    """torchrun's documented usage: no --out-dir; rank 0 picks the timestamped directory and shares it."""
    args = [*ARGS[:-2], "--max-steps", "5"]  # ARGS ends with --max-steps STEPS
    done = _run([*TORCHRUN, "--data", str(corpus), *args, "--batch-size", "4"], tmp_path)
    assert done.returncode == 0, done.stderr
    (run,) = (tmp_path / "runs").iterdir()  # one directory for both processes
    assert run.name.startswith("excerpt-char-")
    assert [r["step"] for r in _rows(run)] == [5]
    assert len(re.findall(r"^step +5 ", done.stderr, flags=re.M)) == 1


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_batch_norm_is_refused_under_every_multi_process_strategy(strategy: str) -> None:
    model = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=20, d_model=16, n_layers=1, n_heads=2, norm="batch"))
    ctx = DistContext(rank=0, world_size=2, strategy=strategy, device=torch.device("cpu"))  # refused before any call
    with pytest.raises(QkvError, match="norm=batch keeps per-rank running statistics"):
        wrap_model(model, ctx)
