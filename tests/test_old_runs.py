"""Every kind of run directory that qkv wrote before the component-config redesign keeps working.

tests/fixtures/old_runs/ae117cc holds runs made by commit ae117cc with tests/fixtures/old_runs/make.sh (flat model and
run configs in config.json): a character-level and a BPE language model, a masked language model, a translation
run, the copy and reverse tasks, a LoRA run and a full chat fine-tune of the BPE model, and a 2-process FSDP run
with its DCP shards. Beside them, what that commit printed for `qkv eval`, `qkv generate` and `qkv translate`, and
the metrics and the last weights that `qkv train --resume --max-steps 6` reached. Today's code must give the same
text and the same numbers, bit for bit on the kind of CPU that made them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import one_thread, run_main

from qkv.io.files import load_safetensors

FIXTURES = Path(__file__).parent / "fixtures" / "old_runs" / "ae117cc"
ROOT = "/tmp/qkvfx"  # the directory the fixtures were made in, which their configs name
RUNS = ("lm", "bpe", "mlm", "translate", "copy", "reverse", "lora", "chat", "fsdp")
LOSSES = ("step", "tokens_seen", "train_loss", "val_loss", "val_bpb", "val_accuracy", "val_bleu", "val_exact_match")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the fixtures whose configs name where the copy is."""
    root = tmp_path_factory.mktemp("old-runs") / "runs"
    shutil.copytree(FIXTURES, root)
    for config in root.glob("*/config.json"):
        config.write_text(config.read_text().replace(ROOT, str(root)))
    return root


def _same_cpu() -> bool:
    """Whether this CPU is of the kind that made the fixtures (float sums may differ in the last bit elsewhere)."""
    made_on = (FIXTURES / "expected" / "cpu.txt").read_text().strip()
    return any(made_on in line for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line)


def _close(a: torch.Tensor | float, b: torch.Tensor | float) -> bool:
    """Equal bit for bit on the fixtures' kind of CPU, within 1e-6 elsewhere."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return bool(torch.equal(a, b)) if _same_cpu() else bool(torch.allclose(a, b, rtol=0, atol=1e-6))


@pytest.mark.parametrize("name", RUNS)
def test_an_old_run_evaluates_as_it_did(root: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with one_thread():
        code, out, err = run_main(capsys, "eval", str(root / name))
    assert (code, err) == (0, "")
    assert out == (FIXTURES / "expected" / name / "eval.txt").read_text()


@pytest.mark.parametrize("name", ["lm", "bpe", "lora"])
def test_an_old_language_model_generates_as_it_did(root: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with one_thread():
        code, out, err = run_main(capsys, "generate", str(root / name), "--prompt", "ROMEO:", "--max-new-tokens", "20",
                                  "--seed", "1")  # fmt: skip
    assert (code, err) == (0, "")
    assert out == (FIXTURES / "expected" / name / "generate.txt").read_bytes().decode()


def test_an_old_translation_run_translates_as_it_did(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with one_thread():
        code, out, err = run_main(capsys, "translate", str(root / "translate"), "Wie geht es dir?", "--beam", "2")
    assert (code, err) == (0, "")
    assert out == (FIXTURES / "expected" / "translate" / "translate.txt").read_text()


@pytest.mark.parametrize("name", RUNS)
def test_an_old_run_resumes_to_the_same_losses_and_weights(root: Path, name: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    run = Path(shutil.copytree(root / name, tmp_path / name))
    task = json.loads((run / "config.json").read_text())["task"]
    nproc = ["--nproc", "2"] if name == "fsdp" else []
    with one_thread():
        code, _, err = run_main(capsys, "train", task, "--resume", "--out-dir", str(run), "--max-steps", "6", *nproc)
    assert code == 0, err
    expected = FIXTURES / "expected" / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (expected / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [w["step"] for w in want] == [2, 4, 6]
    for row, wanted in zip(rows, want, strict=True):
        assert {k for k in row if k in LOSSES} == {k for k in wanted if k in LOSSES}
        for key in LOSSES:
            if key in wanted:
                assert _close(row[key], wanted[key]), (row["step"], key, row[key], wanted[key])
    got, stored = load_safetensors(run / "last.safetensors"), load_safetensors(expected / "last.safetensors")
    assert got.keys() == stored.keys()
    assert all(_close(got[k], stored[k]) for k in stored), max(float((got[k] - stored[k]).abs().max()) for k in stored)
