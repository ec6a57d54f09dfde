"""`qkv interpret`: each view prints the Python API's numbers, and each mistake is one line with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.interpret import head_scores, logit_attribution, logit_lens, repeated_tokens
from qkv.tasks import load


@pytest.fixture(scope="module")
def run(explore_root: Path) -> Path:
    return explore_root / "runs" / "lm"


def _call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["interpret", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_lens_prints_the_top_token_and_probability_of_every_stream(run: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _call(capsys, "lens", str(run), "--prompt", "To be")
    assert code == 0
    loaded = load(run, "best", "cpu", "lm")
    ids = loaded.require_tokenizer().encode_tensor("To be")[None]
    probs, _ = logit_lens(loaded.model, ids).top(1)
    rows = out.splitlines()
    assert rows[1].startswith("embeddings") and rows[3].startswith("after layer 1")
    last = rows[3].split()[-1]
    assert last == f"{float(probs[-1, 0, -1, 0]):.2f}"
    assert "lens: final norm (RMSNorm) recomputed" in out


def test_heads_and_attribution_print_the_apis_numbers(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = load(run, "best", "cpu", "lm")
    code, out, _ = _call(capsys, "heads", str(run), "--length", "10", "--batch", "2", "--seed", "3")
    assert code == 0
    vocab = loaded.require_tokenizer().vocab_size
    ids = repeated_tokens(2, 10, vocab, torch.Generator().manual_seed(3), min(vocab // 10, 1000))
    induction, _ = head_scores(loaded.model, ids)
    row0 = out.splitlines()[2].split()
    assert row0 == ["0", *(f"{float(v):.2f}" for v in induction[0])]
    code, out, _ = _call(capsys, "attribution", str(run), "--prompt", "To be or", "--answer", "e", "--wrong", "a")
    assert code == 0
    tok = loaded.require_tokenizer()
    want = logit_attribution(loaded.model, tok.encode_tensor("To be or")[None], tok.encode("e")[0], tok.encode("a")[0])
    assert f"= the logit difference {want.total:+.3f}" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["patch", "{run}", "--clean", "To be", "--corrupted", "To be or"],
     "the clean and corrupted prompts must have the same token length, got 5 and 8 tokens"),
    (["patch", "{run}", "--clean", "To be", "--corrupted", "To"],
     "the clean and corrupted prompts must have the same token length, got 5 and 2 tokens"),
    (["patch", "{run}", "--clean", "To be", "--corrupted", "To bx", "--answer", "ab"],
     "--answer 'ab' is 2 tokens ('a', 'b'); give exactly one token"),
    (["attribution", "{run}", "--prompt", "To be", "--answer", "e", "--layer", "7"],
     "--layer 7 is out of range: the model has 2 layers (0–1)"),
    (["hooks", "{run}", "--prompt", "To be", "--hook", "decoder.layers.1.attn.patern"],
     "unknown hook name 'decoder.layers.1.attn.patern'; did you mean decoder.layers.1.attn.pattern"),
    (["hooks", "{run}", "--prompt", "To be", "--hook", "decoder.layers.0.attn.pattern", "--head", "2"],
     "--head must be in 0–1 for decoder.layers.0.attn.pattern, got 2"),
    (["lens", "{run}", "--prompt", ""], "--prompt is empty"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_code_2(run: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                               message: str) -> None:  # fmt: skip
    code, out, err = _call(capsys, *(a.format(run=run) for a in argv))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert out == "", out  # nothing printed before the error


def test_hooks_lists_every_name_and_prints_one_pattern(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _call(capsys, "hooks", str(run))
    assert code == 0 and out.splitlines()[0] == "decoder.layers.0.resid_pre" and len(out.splitlines()) == 16
    code, out, _ = _call(capsys, "hooks", str(run), "--prompt", "To be", "--hook", "decoder.layers.1.attn.pattern",
                         "--head", "1")  # fmt: skip
    lines = out.splitlines()
    assert code == 0 and lines[0] == "decoder.layers.1.attn.pattern: shape (1, 2, 5, 5)"
    assert lines[1].split() == ["1.000", "0.000", "0.000", "0.000", "0.000"]
