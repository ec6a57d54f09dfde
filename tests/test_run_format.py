"""Run directories keep working: the ones written before the one-loop refactor (tests/fixtures/run_dirs, made by
commit eafba67) load, generate, translate, evaluate and resume, and their configs are migrated on reading.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import config, one_thread, run_main

from qkv.io.files import load_safetensors
from qkv.io.run_dir import migrate_config, migrate_state
from qkv.tasks import load, train
from qkv.tasks.lm import LMRun
from qkv.tasks.translate import TranslationRun

FIXTURES = Path(__file__).parent / "fixtures" / "run_dirs"


def _copy(name: str, tmp_path: Path) -> Path:
    """A writable copy of a fixture run."""
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def test_old_configs_are_migrated() -> None:
    lm = json.loads((FIXTURES / "lm-v0" / "config.json").read_text())
    assert "task" not in lm and "bpe_vocab_size" in lm["training"]
    new = migrate_config(lm)
    assert new["task"] == "lm" and new["training"]["vocab_size"] == 1024 and "bpe_vocab_size" not in new["training"]
    tr = migrate_config(json.loads((FIXTURES / "translate-v0" / "config.json").read_text()))
    assert tr["task"] == "translate" and tr["training"]["batch_size"] == 200 and "batch_tokens" not in tr["training"]
    assert migrate_state({"step": 4, "elapsed_s": 3.0, "best_val_bleu": 0.5})["best"] == 0.5
    assert migrate_state({"step": 4, "elapsed_s": 3.0, "train_s": 2.0, "best_val_loss": 3.0}) == {
        "step": 4, "elapsed_s": 3.0, "train_s": 2.0, "best": 3.0}  # fmt: skip


def test_an_old_language_model_run_loads_generates_evaluates_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy("lm-v0", tmp_path)
    loaded = load(run)
    assert isinstance(loaded, LMRun) and loaded.config.block_size == 32 and loaded.config.vocab_size == 1024
    code, out, err = run_main(
        capsys, "generate", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "12", "--seed", "1"
    )
    assert (code, err) == (0, "") and out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 12 + 1
    code, out, err = run_main(capsys, "eval", str(run))
    assert (code, err) == (0, "")
    pattern = (r"val loss \d\.\d{4}  perplexity \d+\.\d{3}  bits per byte \d\.\d{3}  \(113,075 positions, block "
               r"size 32, best weights\)\n")  # fmt: skip
    assert re.fullmatch(pattern, out)
    # Today's loop reproduces the old run's step-4 weights from scratch (bit for bit on the machine that made
    # them; float sums may differ a little on another CPU), and resumes both the same way.
    stored = migrate_config(json.loads((FIXTURES / "lm-v0" / "config.json").read_text()))["training"]
    with one_thread():
        fresh = train(config("lm", **{**stored, "out_dir": str(tmp_path / "fresh")}), verbose=False)
    assert fresh.step == 4 and _max_diff(run, fresh.run_dir) < 1e-5
    for directory in (run, fresh.run_dir):
        with one_thread():
            assert run_main(capsys, "train", "--resume", "--out-dir", str(directory), "--max-steps", "6")[0] == 0
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6]
    config = json.loads((run / "config.json").read_text())
    assert config["task"] == "lm" and config["training"]["max_steps"] == 6  # the extended schedule is stored
    assert _max_diff(run, fresh.run_dir) < 1e-5


def _max_diff(a: Path, b: Path) -> float:
    """The largest difference between the latest weights of two runs."""
    wa, wb = load_safetensors(a / "last.safetensors"), load_safetensors(b / "last.safetensors")
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def test_an_old_translation_run_loads_translates_evaluates_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy("translate-v0", tmp_path)
    loaded = load(run)
    assert isinstance(loaded, TranslationRun) and loaded.config.batch_size == 200
    code, out, err = run_main(capsys, "translate", str(run), "Wie geht es dir?", "--beam", "2")
    assert (code, err) == (0, "") and out.count("\n") == 1
    assert run_main(capsys, "eval", str(run), "--batch-size", "0") == (2, "", "qkv eval: error: batch size must "
                                                                         "be at least 1, got 0\n")  # fmt: skip
    code, out, err = run_main(capsys, "eval", str(run), "--beam", "1")
    assert (code, err) == (0, "")
    assert re.fullmatch(r"test  greedy: BLEU +\d+\.\d\d  chrF +\d+\.\d\d  \(1000 sentences, best weights\)\n", out)
    with one_thread():
        assert run_main(capsys, "train", "translate", "--resume", "--out-dir", str(run), "--max-steps", "4")[0] == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and all("val_bleu" in r for r in rows)
    state = load_safetensors(run / "last.safetensors")
    assert all(torch.isfinite(t).all() for t in state.values())


def test_a_run_with_the_unsharded_checkpoint_resumes_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lm-v1 (written by commit 09cba36, stopped at step 12 with its checkpoint at step 10 in last_state.json,
    last.safetensors and last_optim.safetensors) resumes to the uninterrupted run's weights, bit for bit; its
    next checkpoint is sharded and the old resume files go."""
    run = _copy("lm-v1", tmp_path)
    args = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--block-size", "16", "--batch-size", "4",
            "--eval-interval", "5", "--eval-tokens", "256", "--sample-tokens", "0", "--max-steps", "20",
            "--device", "cpu"]  # fmt: skip
    with one_thread():
        assert run_main(capsys, "train", "--resume", "--out-dir", str(run))[0] == 0
        assert run_main(capsys, "train", *args, "--out-dir", str(tmp_path / "whole"))[0] == 0
    got, want = load_safetensors(run / "last.safetensors"), load_safetensors(tmp_path / "whole" / "last.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not (run / "last_state.json").exists() and not (run / "last_optim.safetensors").exists()
    assert json.loads((run / "checkpoint" / "latest.json").read_text())["step"] == 20
