"""Tests for qkv.training: exact resume after SIGKILL and Ctrl-C, crash-safe checkpoints, the eval protocol,
the run directory, and cached vs uncached generation on a trained run.

Every model here is tiny (1 layer, d_model 32, block 32, batch 4) on a 20,000-character excerpt of the
embedded corpus, so the whole file stays fast on two CPU cores.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from helpers import checkpoint_dir, config, model_cfg, one_thread, read_dcp, shard_dir
from safetensors import safe_open

from qkv.attention import new_cache
from qkv.data import eval_windows, load_shakespeare
from qkv.data.batches import eval_batch
from qkv.data.cache import open_text
from qkv.errors import QkvError
from qkv.generation import Sampling, generate, stream
from qkv.io import files
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.tasks import load, train
from qkv.tasks.lm import LMConfig
from qkv.training import checkpoint as ckpt
from qkv.training import evaluate_loss
from qkv.training.distributed import DistContext
from qkv.training.evaluate import eval_batches
from qkv.training.optim import make_optimizer

MODEL = {"n_layers": 1, "d_model": 32, "n_heads": 2, "dropout": 0.1}
TINY_ARGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--dropout", "0.1", "--block-size", "32",
             "--batch-size", "4", "--eval-interval", "5", "--eval-tokens", "2000", "--sample-tokens", "0",
             "--device", "cpu"]  # fmt: skip
COMPARED = ("step", "tokens_seen", "train_loss", "val_loss")


def _qkv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m qkv ARGS` in a fresh process (one BLAS thread: the box has two cores and is shared)."""
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, cwd=cwd,
                          env=_env(), timeout=300)  # fmt: skip


def _env() -> dict[str, str]:
    """The environment of every subprocess."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _tiny_config(corpus: Path, out_dir: Path, max_steps: int, **overrides: Any) -> LMConfig:
    """The in-process twin of `qkv train --data CORPUS TINY_ARGS --max-steps N --out-dir OUT`.

    Like the CLI, the --n-layers etc. values are laid over the default recipe's model fields.
    """
    model = dict(MODEL)  # over the recipe's model
    settings: dict[str, Any] = {"data": str(corpus), "model": model, "block_size": 32, "batch_size": 4,
                                "eval_interval": 5, "eval_tokens": 2000, "sample_tokens": 0, "device": "cpu",
                                "max_steps": max_steps, "out_dir": str(out_dir)}  # fmt: skip
    return config("lm", **{**settings, **overrides})


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows, restricted to the fields a resumed run must reproduce exactly."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line)[k] for k in COMPARED} for line in lines if line.strip()]


def _state_step(run_dir: Path) -> int | None:
    """The step of the checkpoint in run_dir, or None while there is none."""
    try:
        return int(json.loads((run_dir / "checkpoint" / "latest.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 20,000-character text: 18,000 train / 2,000 val characters."""
    path = tmp_path_factory.mktemp("data") / "excerpt.txt"
    path.write_text(load_shakespeare()[:20_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory of 120 documents (char tokens, 1 in 10 held out) in training shards of ~20,000 tokens."""
    return shard_dir(tmp_path_factory.mktemp("shards"))


class _References:
    """Uninterrupted in-process runs, one per data and max_steps, trained on first use."""

    def __init__(self, root: Path, corpus: Path) -> None:
        self.root, self.corpus, self.runs = root, corpus, {}  # type: ignore[var-annotated]

    def __call__(self, max_steps: int, data: Path | None = None) -> Path:
        data = data or self.corpus
        if (data, max_steps) not in self.runs:
            out = self.root / f"ref-{data.name}-{max_steps}"
            with one_thread():
                result = train(_tiny_config(data, out, max_steps), verbose=False)
            assert result.step == max_steps and not result.interrupted
            self.runs[data, max_steps] = out
        return self.runs[data, max_steps]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> _References:
    """Uninterrupted runs with the settings of TINY_ARGS (seed 1337), shared by the tests of this file."""
    return _References(tmp_path_factory.mktemp("reference"), corpus)


# --- 1. resume is exact -------------------------------------------------------------------------------


def _killed_run(corpus: Path, out: Path, max_steps: int) -> int | None:
    """Start a run, SIGKILL it once a checkpoint at step ≥ 10 exists; the checkpoint step, or None if it finished."""
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "train", "--data", str(corpus), *TINY_ARGS,
                             "--max-steps", str(max_steps), "--out-dir", str(out)],
                            cwd=out.parent, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            step = _state_step(out)
            if step is not None and step >= 10:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode == -signal.SIGKILL:
        return _state_step(out)
    assert proc.returncode == 0, f"training failed before the kill:\n{stderr.decode()}"
    return None  # finished before we saw a step-10 checkpoint: the caller retries with a longer run


@pytest.mark.parametrize("data", ["corpus", "shards"])
def test_sigkill_then_resume_reproduces_the_uninterrupted_run(
    tmp_path: Path, data: str, reference: _References, request: pytest.FixtureRequest
) -> None:
    """SIGKILL mid-run + `--resume` gives bit-identical metrics.jsonl rows, weights, optimizer state and generator
    state (dropout 0.1, so RNG restore matters), on a text file and on a data directory of several shards."""
    corpus = request.getfixturevalue(data)
    for max_steps in (40, 80, 160):  # a longer run if the machine was fast enough to finish first
        killed = tmp_path / f"killed-{max_steps}"
        step_at_kill = _killed_run(corpus, killed, max_steps)
        if step_at_kill is not None:
            break
    assert step_at_kill is not None, "every run finished before it could be killed"
    assert 10 <= step_at_kill < max_steps  # the kill really landed mid-run
    assert len(_rows(killed)) < max_steps // 5

    resumed = _qkv("train", "--resume", "--out-dir", str(killed), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert f"after {max_steps} steps" in resumed.stdout
    logged_steps = [int(s) for s in re.findall(r"^step +(\d+) ", resumed.stderr, flags=re.M)]
    assert logged_steps == list(range(step_at_kill + 5, max_steps + 1, 5))  # continued, did not restart

    expected = _rows(reference(max_steps, corpus))
    assert [r["step"] for r in expected] == list(range(5, max_steps + 1, 5))
    assert _rows(killed) == expected  # exact float equality, row by row
    want_run = reference(max_steps, corpus)
    got, want = (files.load_safetensors(run / "last.safetensors") for run in (killed, want_run))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)  # the exported weights
    for read in (read_dcp, lambda d: files.load_safetensors(d / "rng.safetensors")):  # weights and optimizer; RNGs
        got, want = read(checkpoint_dir(killed)), read(checkpoint_dir(want_run))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    # Training time continues across the resume (it does not restart at 0) and never includes evaluations.
    raw = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert all(b["train_s"] > a["train_s"] for a, b in itertools.pairwise(raw))
    assert all(0 < r["train_s"] < r["elapsed_s"] for r in raw)


def test_resuming_a_finished_run_takes_no_steps(tmp_path: Path, corpus: Path, reference: _References,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """`resume` on a run that already reached max_steps does nothing, says so, and leaves its files untouched."""
    run = tmp_path / "done"
    shutil.copytree(reference(40), run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with one_thread():
        result = train(_tiny_config(corpus, run, 40, resume=True), verbose=True)
    assert "already at step 40 of --max-steps 40: nothing to train" in capsys.readouterr().err
    assert result.step == 40
    assert not result.interrupted
    assert [{k: m[k] for k in COMPARED} for m in result.metrics] == _rows(run)
    assert len(result.metrics) == 8
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_python_api_resume_keeps_the_stored_schedule(tmp_path: Path, reference: _References) -> None:
    """`qkv.train(resume=True, out_dir=D)` without max_steps continues the run's own 40-step schedule."""
    run = tmp_path / "done"
    shutil.copytree(reference(40), run)
    with one_thread():
        result = train(out_dir=str(run), resume=True, device="cpu", verbose=False)
    assert result.step == 40  # not stretched to LMConfig's default of 600 steps
    assert json.loads((run / "config.json").read_text())["training"]["schedule"]["max_steps"] == 40


def test_eval_of_a_run_on_shards_reads_only_the_validation_shards(
    tmp_path: Path, shards: Path, reference: _References
) -> None:
    """`qkv eval RUN` gives training's last evaluation to 1e-6 with the training shards gone (it opens none)."""
    data = tmp_path / "data"
    shutil.copytree(shards, data)
    run = tmp_path / "run"
    with one_thread():
        train(_tiny_config(data, run, 10, final_eval_tokens=3000), verbose=False)
    for shard in data.glob("train_*.bin"):
        shard.rename(shard.with_suffix(".moved"))
    done = _qkv("eval", str(run), "--checkpoint", "last", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = float(re.match(r"val loss (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["full_eval"] and abs(printed - last["val_loss"]) < 1e-4  # printed with 4 decimals
    loaded = load(run, "last")
    assert abs(loaded.val_loss() - last["val_loss"]) < 1e-6


# --- 2. checkpoints are never half-written ----------------------------------------------------------------


def _tiny_lm() -> DecoderLM:
    return DecoderLM(model_cfg(DecoderLMConfig, vocab_size=11, n_layers=1, d_model=16, n_heads=2, max_positions=8))


def _step(model: DecoderLM, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """One optimiser step on a random batch drawn from gen."""
    x = torch.randint(0, 11, (2, 8), generator=gen)
    F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten()).backward()
    opt.step()
    opt.zero_grad()


ONE = DistContext(0, 1, "ddp", torch.device("cpu"))  # one process


def _save(run: Path, model: DecoderLM, opt: torch.optim.Optimizer, gen: torch.Generator, step: int) -> None:
    ckpt.save_checkpoint(run, model, opt, {"step": step}, {"data": gen}, ONE, frozen=False).wait()


def _load(run: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The weights and step of the committed checkpoint, loaded into a fresh model."""
    model = _tiny_lm()
    optimizer = make_optimizer(model, config("lm").optim)
    extra = ckpt.load_checkpoint(run, model, optimizer, {"data": torch.Generator()}, ONE, set())
    return model.state_dict(), extra["step"]


def test_a_save_that_dies_before_its_commit_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that fails anywhere before latest.json names it leaves the previous checkpoint the one that loads;
    the next save of that step replaces its leftover, and a committed save removes the older step directories."""
    torch.manual_seed(0)
    model = _tiny_lm()
    opt = make_optimizer(model, config("lm").optim)
    gen = torch.Generator().manual_seed(5)
    run = tmp_path / "run"
    _step(model, opt, gen)
    _save(run, model, opt, gen, step=1)
    old_weights = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, gen)
    real_write = ckpt.atomic_write_json
    for where in ("state", "pointer"):  # before its shards are written, and after (the commit itself fails)

        def failing(path: Path, obj: Any, where: str = where, **kw: Any) -> None:
            if (path.name == "latest.json") == (where == "pointer"):
                raise OSError("simulated crash")
            real_write(path, obj, **kw)

        monkeypatch.setattr(ckpt, "atomic_write_json", failing)
        with pytest.raises(OSError, match="simulated crash"):
            _save(run, model, opt, gen, step=2)
        monkeypatch.undo()
        weights, step = _load(run)
        assert step == 1 and all(torch.equal(weights[k], old_weights[k]) for k in old_weights), where
        assert (run / "checkpoint" / "step-00000002").is_dir()  # the leftover, named by nothing
    _save(run, model, opt, gen, step=2)
    weights, step = _load(run)
    assert step == 2 and all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest.json", "step-00000002"]


def test_checkpoint_metadata_cannot_run_code(tmp_path: Path) -> None:
    """DCP's .metadata is a pickle: qkv reads it with an allow-list, so one that names any other callable is refused
    before it is called, and a checkpoint holds no pickled Python objects besides it (hyperparameters are JSON)."""
    torch.manual_seed(0)
    model = _tiny_lm()
    opt = make_optimizer(model, config("lm").optim)
    gen = torch.Generator()
    _step(model, opt, gen)
    run = tmp_path / "run"
    _save(run, model, opt, gen, step=1)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(checkpoint_dir(run)).read_metadata()
    assert not [k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)]
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    metadata.storage_meta = Evil()  # type: ignore[assignment]
    (checkpoint_dir(run) / ".metadata").write_bytes(__import__("pickle").dumps(metadata))
    with pytest.raises(QkvError, match=r"checkpoint metadata names (posix|os)\.system, .*refused"):
        _load(run)
    assert not marker.exists()


# --- 6. the evaluation protocol -----------------------------------------------------------------------


def test_eval_windows_cover_every_target_exactly_once() -> None:
    """Concatenated targets are data[1:], in order, for lengths that are and are not multiples of the block."""
    for n in (2, 9, 17, 33, 40):
        data = torch.arange(100, 100 + n)
        ys = [y.flatten() for _, y in eval_windows(data, 8, 3)]
        assert torch.equal(torch.cat(ys), data[1:]), n


def test_evaluate_loss_equals_a_manual_loop_over_positions() -> None:
    """evaluate_loss == mean over t = 1 .. n-1 of -log p(data[t] | the window's tokens before t)."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.of(vocab_size=13, n_layers=1, d_model=16, n_heads=2, max_positions=8)).eval()
    model.double()
    data = torch.randint(0, 13, (30,), generator=torch.Generator().manual_seed(1))  # 29 targets: 3 full windows + 5
    block = 8
    losses = []
    with torch.no_grad():
        for t in range(1, len(data)):
            start = (t - 1) // block * block  # the window holding target t starts here
            logits = model(data[start:t][None])[0, -1]
            losses.append(float(F.cross_entropy(logits[None], data[t : t + 1])))
    manual = sum(losses) / len(losses)
    assert len(losses) == 29
    # evaluate_loss takes the cross-entropy in float32; a position counted twice or skipped moves the mean by ~0.1.
    for batch_size in (1, 2, 64):
        assert evaluate_loss(model, data, block, batch_size) == pytest.approx(manual, abs=1e-6)
    assert evaluate_loss(model, data, block, 4, max_tokens=17) == pytest.approx(sum(losses[:16]) / 16, abs=1e-6)
    assert abs(manual - sum(losses[1:]) / 28) > 1e-3  # the tolerance above is far below one position's weight
    # A larger partial budget reads stretches spread over the split (its first and last 9 tokens here).
    spread = torch.cat([data[:9], data[21:]])
    assert [eval_batch(data, *b)[0].tolist() for b in eval_batches(data, block, 4, max_tokens=18)] == [
        spread[:8][None].tolist(),
        spread[9:17][None].tolist(),
    ]
    with pytest.raises(QkvError, match="need at least 2 tokens to evaluate"):
        evaluate_loss(model, data[:1], block)


# --- 7. the run directory -----------------------------------------------------------------------------


def test_run_directory_contents(reference: _References) -> None:
    """config.json, weights, tokenizer, metrics with every key, a real PNG, and no pickle anywhere."""
    run = reference(40)
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "model.safetensors", "last.safetensors", "checkpoint", "tokenizer.json", "metrics.jsonl",
            "loss.png"} <= names  # fmt: skip
    assert not [n for n in names if n.startswith(".")]  # no temp or staged files left behind
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30, 35, 40]
    for r in rows:
        assert set(r) == {"step", "tokens_seen", "elapsed_s", "train_s", "train_loss", "val_loss", "val_bpb",
                          "full_eval", "lr"}  # fmt: skip
        assert r["full_eval"] == (r["step"] == 40)  # periodic evaluations read eval_tokens; the last one, all
        assert r["tokens_seen"] == r["step"] * 4 * 32
        assert math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"]) and r["lr"] > 0
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-12)  # ASCII: a byte per character
        assert 0 < r["train_s"] < r["elapsed_s"]  # training time excludes the evaluations before this row
    # Each row's overhead (elapsed − train) includes every earlier evaluation, so it only grows.
    overheads = [r["elapsed_s"] - r["train_s"] for r in rows]
    assert all(b > a for a, b in itertools.pairwise(overheads))
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]  # it learned something
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((run / "config.json").read_text())
    assert config["format"] == "qkv-run/2" and config["model"]["decoder"]["block"]["dropout"] == 0.1
    assert config["training"]["schedule"]["max_steps"] == 40
    # No pickle: every file parses as what its name says (a safetensors header is a little-endian
    # length, so its first bytes may look like pickle magic; parsing is the real test).
    for path in run.iterdir():
        if path.name == "checkpoint":  # DCP's own files: see test_checkpoint_metadata_cannot_run_code
            continue
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                assert list(f.keys()), path.name
        elif path.suffix in (".json", ".jsonl"):
            for line in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
                json.loads(line)
        else:
            assert path.suffix == ".png", path.name
        assert path.suffix not in files.PICKLE_SUFFIXES, path.name
    for name in ("model.safetensors", "last.safetensors"):
        assert safetensors.torch.load_file(run / name)  # parses as safetensors, not merely named so


# --- 4. generation with and without the KV cache --------------------------------------------------------


def test_cached_generation_matches_uncached_on_a_trained_run(reference: _References) -> None:
    """Greedy and seeded sampling give the same tokens with and without the cache, past the 32-token context."""
    run = load(reference(40))
    ids = run.tokenizer.encode_tensor("ROMEO:\n")[None].repeat(2, 1)
    greedy = [generate(run.model, ids, 40, Sampling(temperature=0.0), use_cache=c) for c in (True, False)]
    assert greedy[0].shape == (2, 7 + 40)
    assert torch.equal(greedy[0], greedy[1])
    for top_k, top_p in ((None, None), (10, None), (None, 0.9)):
        sampled = [
            generate(run.model, ids, 40, Sampling(0.8, top_k, top_p, seed=3), use_cache=c) for c in (True, False)
        ]
        assert torch.equal(sampled[0], sampled[1]), (top_k, top_p)
        assert not torch.equal(sampled[0], greedy[0])  # really sampled


class _ScriptedLM:
    """A stub model: row r emits SCRIPT[r][k] at step k, whatever the input (eos = 0)."""

    SCRIPT = ([5, 0, 9, 9, 9, 9, 9, 9], [3, 4, 0, 8, 8, 8, 8, 8], [7, 7, 7, 7, 0, 6, 6, 6])

    def __init__(self) -> None:
        self.calls = 0

    def new_cache(self, capacity: int = 256) -> Any:
        return new_cache(1, capacity)

    def __call__(self, ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
        logits = torch.full((3, ids.shape[1], 10), -1e4)
        for row, script in enumerate(self.SCRIPT):
            logits[row, -1, script[self.calls]] = 0.0
        self.calls += 1
        return logits


@pytest.mark.parametrize("use_cache", [True, False])
def test_rows_stop_independently_at_eos(use_cache: bool) -> None:
    """A row that produced eos only yields eos afterwards; generation ends when every row has."""
    model = _ScriptedLM()
    steps = list(stream(model, torch.ones(3, 2, dtype=torch.long), 8, Sampling(temperature=0.0), eos_id=0,
                        use_cache=use_cache))  # fmt: skip
    assert torch.stack(steps, 1).tolist() == [[5, 0, 0, 0, 0], [3, 4, 0, 0, 0], [7, 7, 7, 7, 0]]
    assert model.calls == 5  # stopped at the fifth step, not max_new_tokens = 8
    sampled = list(stream(_ScriptedLM(), torch.ones(3, 1, dtype=torch.long), 8, Sampling(temperature=1.0, seed=0),
                          eos_id=0, use_cache=use_cache))  # fmt: skip
    assert torch.stack(sampled, 1).tolist() == [[5, 0, 0, 0, 0], [3, 4, 0, 0, 0], [7, 7, 7, 7, 0]]


# --- 8. Ctrl-C ------------------------------------------------------------------------------------------


def test_ctrl_c_saves_a_resumable_checkpoint_and_exits_130(tmp_path: Path, corpus: Path) -> None:
    """SIGINT between checkpoints: exit 130, a new checkpoint at the interrupted step, one --resume hint."""
    out = tmp_path / "interrupted"
    args = list(TINY_ARGS)
    args[args.index("--eval-interval") + 1] = "50"  # the signal lands between checkpoints
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "train", "--data", str(corpus), *args,
                             "--max-steps", "100000", "--out-dir", str(out)], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stderr is not None
        logged = []
        for line in proc.stderr:  # wait for the end of the first checkpoint (its log line comes last)
            logged.append(line)
            if line.startswith("step     50 "):
                break
        assert _state_step(out) == 50, "".join(logged)
        time.sleep(0.05)  # a few steps into the next interval
        os.kill(proc.pid, signal.SIGINT)
        stdout, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(logged) + rest
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    hints = [line for line in stderr.splitlines() if "--resume" in line]
    assert len(hints) == 1, stderr
    match = re.fullmatch(rf"interrupted at step (\d+): checkpoint saved; continue with --resume --out-dir {out}",
                         hints[0])  # fmt: skip
    assert match, hints[0]
    step = int(match.group(1))
    assert 50 < step < 100  # interrupted mid-interval ...
    assert _state_step(out) == step  # ... and checkpointed at exactly that step
    assert [r["step"] for r in _rows(out)] == [50, step]
    assert "validation loss" in stdout

    with one_thread():
        result = train(config("lm", out_dir=str(out), resume=True, max_steps=step + 3, device="cpu"), verbose=False)
    assert result.step == step + 3 and not result.interrupted
    assert [r["step"] for r in result.metrics][-2:] == [step, step + 3]
    assert _state_step(out) == step + 3


def test_a_text_file_splits_by_characters(corpus: Path) -> None:
    """90 % / 10 % of the characters; the char vocabulary covers both splits."""
    data = open_text(str(corpus))
    train, val = data.split("train"), data.split("val")
    assert (len(train), len(val)) == (18_000, 2_000)
    assert data.tokenizer.decode(val[0:2000].tolist()) == corpus.read_text()[18_000:]
    assert data.tokenizer.decode(train[0:18_000].tolist()) == corpus.read_text()[:18_000]


# --- torch.compile ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path: Path, corpus: Path) -> None:
    """--compile (inductor's C++ kernels on the CPU) takes the same steps as eager, to fp32 reassociation."""
    model = {**MODEL, "dropout": 0.0}  # compiled dropout draws from its own RNG
    rows = {}
    for compile_ in (False, True):
        out = tmp_path / f"compile-{compile_}"
        with one_thread():
            result = train(_tiny_config(corpus, out, 10, model=model, compile=compile_), verbose=False)
        assert result.step == 10
        rows[compile_] = _rows(out)
    assert [r["step"] for r in rows[True]] == [r["step"] for r in rows[False]] == [5, 10]
    for compiled, eager in zip(rows[True], rows[False], strict=True):
        assert compiled["train_loss"] == pytest.approx(eager["train_loss"], abs=1e-4)
        assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-4)


def test_one_process_compiles_the_loss_into_the_training_graph(tmp_path: Path, corpus: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A training step's graph holds the model and its cross-entropy (the float32 cast and log-softmax fuse with
    the head), not the model alone; evaluation still runs the compiled model."""
    import qkv.training.compiled as compiled
    from qkv.training import Hooks

    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, inputs: Any) -> Any:  # dynamo's graphs, run as captured
        graphs.append(gm)
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": record}))
    assert compiled.torch.compile is not compile_
    model = {**MODEL, "dropout": 0.0}
    with one_thread():
        train(_tiny_config(corpus, tmp_path / "run", 2, model=model, compile=True), verbose=False,
              hooks=Hooks(evaluate=False))  # fmt: skip
    assert len(graphs) == 1  # one graph, traced once for both steps
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("cross_entropy" in t for t in targets), targets
    assert any("linear" in t or "matmul" in t for t in targets)  # and the model's layers in the same graph


@pytest.mark.parametrize("per_layer", [False, True])
def test_compile_covers_the_criterion_on_one_process_and_with_several(
    per_layer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """step_loss: one process compiles model and criterion as one graph; with several (the layers compiled one by
    one elsewhere) the criterion is a graph of its own. Both give eager's loss and gradients."""
    from qkv.lab.induction_task import InductionTask, recipe
    from qkv.training.compiled import step_loss

    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": record}))
    task = InductionTask(recipe().override({"model": {"n_layers": 1, "d_model": 32, "n_heads": 2}, "length": 12,
                                            "min_length": 4, "vocab": 20}))  # fmt: skip
    torch.manual_seed(0)
    model = task.build_model()
    batch = task.collate(task.draw(torch.Generator().manual_seed(1), 4, 1), torch.device("cpu"))
    eager = task.loss(model, batch)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    torch._dynamo.reset()
    compiled = step_loss(task, model, model, True, per_layer=per_layer)(batch)
    grads = torch.autograd.grad(compiled, list(model.parameters()))
    assert float(compiled) == pytest.approx(float(eager), abs=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(grads, eager_grads, strict=True)) < 1e-6
    assert len(graphs) == 1
    targets = " ".join(str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function")
    assert "cross_entropy" in targets
    assert ("linear" in targets) is not per_layer  # the model is in the graph on one process only


def test_auto_precision_is_float32_on_the_cpu_and_bf16_with_tf32_on_cuda(tmp_path: Path) -> None:
    from helpers import tiny_data, tiny_settings

    from qkv.io.devices import matmul_precision, resolve_dtype
    from qkv.tasks import train

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (resolve_dtype("auto", cpu), resolve_dtype("auto", cuda)) == ("float32", "bfloat16")
    assert resolve_dtype("float32", cuda) == "float32" and resolve_dtype("bfloat16", cpu) == "bfloat16"
    before = torch.backends.cuda.matmul.allow_tf32
    for device, dtype, tf32 in ((cuda, "bfloat16", True), (cuda, "float32", before), (cpu, "bfloat16", before)):
        with matmul_precision(device, dtype):
            assert torch.backends.cuda.matmul.allow_tf32 == tf32
        assert torch.backends.cuda.matmul.allow_tf32 == before  # restored
    train(config("lm", **tiny_settings("lm", tiny_data(tmp_path / "data")), out_dir=str(tmp_path / "run")),
          verbose=False)  # fmt: skip
    assert json.loads((tmp_path / "run" / "config.json").read_text())["training"]["system"]["dtype"] == "float32"


def test_out_of_memory_names_the_size_each_allocator_asked_for() -> None:
    """The CPU allocator's, numpy's and CUDA's out-of-memory errors give their size; other errors are not OOM."""
    import numpy as np

    from qkv.io.devices import out_of_memory

    def raised(make: Any) -> BaseException:
        try:
            make()
        except Exception as e:  # each allocator raises its own type
            return e
        raise AssertionError("the allocation succeeded")

    assert out_of_memory(raised(lambda: torch.empty(2**45))) == "131,072.0 GiB asked for"  # bytes, given in bytes
    assert out_of_memory(raised(lambda: np.empty((2**40, 16)))) == "128 TiB asked for"  # numpy: "128. TiB"
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
                                  "79.19 GiB of which 3.56 GiB is free.")  # fmt: skip
    assert out_of_memory(cuda) == "20.00 GiB asked for"
    assert out_of_memory(torch.OutOfMemoryError("CUDA error: out of memory")) == ""
    assert out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert out_of_memory(ValueError("can't allocate memory")) is None
