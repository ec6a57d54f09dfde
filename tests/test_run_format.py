"""Run directories keep working: the ones written before the one-loop refactor (tests/fixtures/run_dirs, made by
commit eafba67) load, generate, translate, evaluate and resume, and their configs are migrated on reading.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import one_thread, run_main

from qkv.io.files import load_safetensors
from qkv.io.run_dir import migrate_config, migrate_state
from qkv.tasks import config_class, load, train
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


def test_an_old_language_model_run_loads_generates_and_evaluates(
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
    # them; float sums may differ a little on another CPU).
    stored = json.loads((FIXTURES / "lm-v0" / "config.json").read_text())
    with one_thread():
        fresh = train(config_class("lm").from_stored(migrate_config(stored)).override({"out_dir": str(tmp_path / "f")}),
                      verbose=False)  # fmt: skip
    assert fresh.step == 4 and _max_diff(run, fresh.run_dir) < 1e-5


def _max_diff(a: Path, b: Path) -> float:
    """The largest difference between the latest weights of two runs."""
    wa, wb = load_safetensors(a / "last.safetensors"), load_safetensors(b / "last.safetensors")
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def test_an_old_translation_run_loads_translates_and_evaluates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy("translate-v0", tmp_path)
    loaded = load(run)
    assert isinstance(loaded, TranslationRun) and loaded.config.data.batch_size == 200
    code, out, err = run_main(capsys, "translate", str(run), "Wie geht es dir?", "--beam", "2")
    assert (code, err) == (0, "") and out.count("\n") == 1
    assert run_main(capsys, "eval", str(run), "--batch-size", "0") == (2, "", "qkv eval: error: batch size must "
                                                                         "be at least 1, got 0\n")  # fmt: skip
    code, out, err = run_main(capsys, "eval", str(run), "--beam", "1")
    assert (code, err) == (0, "")
    assert re.fullmatch(r"test  greedy: BLEU +\d+\.\d\d  chrF +\d+\.\d\d  \(1000 sentences, best weights\)\n", out)


@pytest.mark.parametrize("name", ["lm-v0", "lm-v1", "translate-v0"])
def test_a_run_of_the_four_day_checkpoint_format_says_how_to_go_on(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Runs that kept their resume state in last_state.json (before sharded checkpoints) do not resume: one line says
    so, and a new run starts from their weights with --init-from."""
    run = _copy(name, tmp_path)
    task = "translate" if name.startswith("translate") else "lm"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, _, err = run_main(capsys, "train", task, "--resume", "--out-dir", str(run), "--max-steps", "20")
    assert code == 2 and err == (f"qkv train: error: {run} keeps its resume state in last_state.json, the format of "
                                 "qkv before sharded checkpoints, which no longer resumes; its weights still load, "
                                 f"evaluate and generate: to train on, start a new run from them with --init-from "
                                 f"{run}\n")  # fmt: skip
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing of the run changed
    if task == "lm":
        code, _, err = run_main(capsys, "train", "--init-from", str(run), "--max-steps", "2", "--eval-interval", "2",
                                "--sample-tokens", "0", "--block-size", "16", "--eval-tokens", "256", "--out-dir",
                                str(tmp_path / "next"))  # fmt: skip
        assert code == 0, err
