"""Tests for the lab (`qkv.lab`, `qkv lab …`): every experiment's numbers against theory or the library,
every command as a real process, every figure labelled, and the HTML report in a real headless browser.

Budget: under 60 s on 2 busy cores. The experiments run at their (small) defaults; the command-line runs
go four processes at a time; one tiny trained run (1 layer, d_model 32, 10 steps) serves every test
that needs a model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import chrome, config, find_browser, model_cfg, run_main

import qkv
from qkv.errors import QkvError
from qkv.lab import (
    attention_map,
    decoder_attention_maps,
    heads,
    masks,
    norms,
    positional,
    softmax,
    softmax_jacobian,
    trainable_walkthrough,
    transformer_attention_maps,
    variance,
    walkthrough,
)
from qkv.lab.attention_map import bertviz_arguments, export_bertviz, plot_layers
from qkv.lab.positional import rotation
from qkv.lab.softmax import stable_softmax
from qkv.lab.walkthrough import SENTENCES, builtin_example, load_embeddings
from qkv.models import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig
from qkv.tasks import train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXPERIMENTS = ("variance", "softmax", "walkthrough", "positional", "norms", "masks", "heads")
TINY = {"model": {"n_layers": 1, "d_model": 32, "n_heads": 2}, "block_size": 32, "batch_size": 4, "max_steps": 10,
        "eval_interval": 10, "eval_tokens": 2000, "sample_tokens": 0, "device": "cpu"}  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as `qkv train --n-layers 1 --d-model 32 --n-heads 2 --block-size 32 … --max-steps 10` writes."""
    out = tmp_path_factory.mktemp("tiny-run")
    train(config("lm", **TINY, out_dir=str(out)), verbose=False)
    return out


def _is_png(path: Path) -> bool:
    """A non-trivial file that starts with the PNG signature."""
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def _qkv(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m qkv ARGV` as a real process."""
    return subprocess.run([sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, cwd=cwd, env=ENV,
                          timeout=240)  # fmt: skip


# ----------------------------------------------------------------------------------------------- numbers


def test_variance_matches_d_k_unscaled_and_1_scaled() -> None:
    r = variance(d_ks=(5, 100, 512), trials=1000, seed=0)
    assert np.all(np.abs(r.var_unscaled / r.d_ks - 1) <= 0.10), r.var_unscaled
    assert np.all(np.abs(r.var_scaled - 1) <= 0.10), r.var_scaled
    assert np.all(np.abs(r.dice_var_sum / (r.d_ks * 35 / 12) - 1) <= 0.15)
    assert "var(q·k/√d_k)" in r.table()


def test_softmax_closed_form_and_saturation() -> None:
    r = softmax(base=(1, 1, 2), scales=(1, 10, 100))
    for a, p in zip(r.scales, r.probs, strict=True):
        # [1, 1, e^a] / (2 + e^a), written with e^-a so that a = 100 does not overflow.
        expected = np.array([np.exp(-a), np.exp(-a), 1.0]) / (2 * np.exp(-a) + 1)
        np.testing.assert_allclose(p, expected, rtol=0, atol=1e-6)
    assert np.all(np.diff(r.max_prob) > 0) and np.all(np.diff(r.jacobian_norm) < 0)
    assert r.max_prob[-1] > 1 - 1e-6 and r.jacobian_norm[-1] < 1e-6  # one-hot, no gradient
    # Unscaled rows saturate as d_k grows; scaled ones do not.
    assert np.all(np.diff(r.max_prob_unscaled) > 0) and np.all(np.diff(r.grad_norm_unscaled) < 0)
    assert np.ptp(r.max_prob_scaled) < 0.05 and np.ptp(r.grad_norm_scaled) < 0.05


def test_softmax_jacobian_equals_autograd() -> None:
    rows = [a * np.array([1.0, 1.0, 2.0]) for a in (1, 10, 100)] + list(np.random.default_rng(0).normal(size=(3, 5)))
    for x in rows:
        ours = softmax_jacobian(stable_softmax(x))
        theirs = torch.autograd.functional.jacobian(
            lambda t: torch.softmax(t, -1), torch.tensor(x, dtype=torch.float64)
        )
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("sentence", sorted(SENTENCES))
def test_walkthrough_context_is_attention(sentence: str, scale: bool) -> None:
    words, emb = builtin_example(sentence)
    w = walkthrough(words, emb, "bank", scale=scale)
    np.testing.assert_allclose(w.context, w.weights @ emb, atol=1e-12)
    np.testing.assert_allclose(w.weighted.sum(axis=0), w.context, atol=1e-12)
    np.testing.assert_allclose(w.weights, w.exp_scores / w.exp_scores.sum(), atol=1e-12)
    assert w.scores.shape == w.exp_scores.shape == w.weights.shape == (len(words),) and w.weighted.shape == emb.shape
    e = torch.tensor(emb)
    attended = qkv.scaled_dot_product_attention(e, e, e, scale=None if scale else 1.0)  # None = 1/√d
    np.testing.assert_allclose(w.context, attended[w.query_index].numpy(), atol=1e-12)
    finance, nature = w.context[0], w.context[1]
    assert (nature > finance) if sentence == "river" else (finance > nature)  # the two meanings of "bank"
    assert (
        walkthrough(words, emb, words.index("bank")).context.tolist()
        == walkthrough(words, emb, "bank").context.tolist()
    )
    assert "exp(score)" in str(w) and "bank" in w.table()


def test_trainable_walkthrough_shapes_and_sdpa() -> None:
    t = trainable_walkthrough()
    assert t.words == ["The", "next", "day", "is", "bright"] and t.x.shape == (5, 8)
    assert t.w_q.shape == t.w_k.shape == t.w_v.shape == (8, 4)
    assert t.q.shape == t.k.shape == t.v.shape == t.context.shape == (5, 4) and t.scores.shape == (5, 5)
    np.testing.assert_allclose(t.weights.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(t.weights, stable_softmax(t.scores / 2.0), atol=1e-12)  # 1/√d_out = 1/2
    np.testing.assert_allclose(t.context, t.weights @ t.v, atol=1e-12)
    assert "shape (5, 5)" in t.table() and "shape (5, 4)" in t.table()


def test_positional_rotation_holds() -> None:
    r = positional(max_len=100, d_model=64, offsets=(1, 2, 5, 10, 25))
    assert r.rotation_error.max() < 1e-5, r.rotation_error
    assert r.toeplitz_error < 1e-4
    # M_k is built from k alone: orthogonal, and M_j M_k = M_{j+k}.
    m3, m4, m7 = rotation(3, 16), rotation(4, 16), rotation(7, 16)
    np.testing.assert_allclose(m3 @ m3.T, np.eye(16), atol=1e-12)
    np.testing.assert_allclose(m3 @ m4, m7, atol=1e-12)


def test_norms_batch_dependence() -> None:
    r = norms(batch_sizes=(64, 8, 2, 1), timing_reps=2)
    bn, ln, rms = 0, 1, 2
    assert np.all(r.batchmate_spread[ln] == 0) and np.all(r.batchmate_spread[rms] == 0)  # identical, whatever the mates
    assert np.all(r.output_gap[ln] < 1e-6) and np.all(r.output_gap[rms] < 1e-6)
    assert np.all(r.batchmate_spread[bn][:3] > 1e-2)  # batch sizes 64, 8, 2 have mates, and they matter
    assert r.output_gap[bn][-1] > r.output_gap[bn][0] and r.stat_gap[-1] > r.stat_gap[0]  # worse as the batch shrinks
    rows = dict(zip(r.rows, range(4), strict=True))
    assert r.feature_mean[rows["BatchNorm"]] < 1e-5 and abs(r.feature_std[rows["BatchNorm"]] - 1) < 1e-3
    assert r.token_mean[rows["LayerNorm"]] < 1e-5 and abs(r.token_std[rows["LayerNorm"]] - 1) < 1e-3
    assert abs(r.token_rms[rows["RMSNorm"]] - 1) < 1e-3
    assert np.all(r.timing_ms > 0) and "INDICATIVE" in r.table()


def test_masks_causal_and_padding() -> None:
    r = masks(length=4)
    assert np.all(np.triu(r.causal_weights, k=1) == 0) and r.max_above_diagonal == 0
    for w in (r.causal_weights, r.padding_weights, r.combined_weights):
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, atol=1e-6)
    assert np.all(r.padding_weights[:, 4:] == 0) and np.all(r.combined_weights[:, 4:] == 0)
    assert np.all(np.triu(r.combined_weights, k=1) == 0)


def test_heads_step_by_step_equals_module() -> None:
    r = heads(seq_len=6, d_model=512, n_heads=8)
    assert r.max_abs_diff < 1e-5 and r.weights_diff < 1e-5
    shapes = [shape for _, _, shape in r.steps]
    assert shapes == [(6, 512)] * 4 + [(8, 6, 64)] * 3 + [(8, 6, 6)] * 2 + [(8, 6, 64), (6, 512), (6, 512)]
    assert "(8, 6, 64)" in r.table()


# ------------------------------------------------------------------------------------------ attention maps


def test_attention_map_of_a_tiny_run(tiny_run: Path, tmp_path: Path) -> None:
    text = "ROMEO: soft!"
    result = attention_map(tiny_run, text)
    n_layers, n_heads, t = 1, 2, len(text)  # char tokenizer: one token per character
    assert [m.weights.shape for m in result.maps] == [(n_heads, t, t)] * n_layers
    assert np.all(np.triu(result.maps[0].weights, k=1) == 0)  # a decoder's self-attention is causal
    paths = plot_layers(result, tmp_path)
    assert len(paths) == n_layers and all(_is_png(p) for p in paths)
    data = json.loads(export_bertviz(result, tmp_path / "bertviz.json").read_text())
    assert set(data) == {"attention", "tokens"} and data["tokens"] == list(text)
    assert np.array(data["attention"]).shape == (n_layers, 1, n_heads, t, t)
    args = bertviz_arguments(tmp_path / "bertviz.json")
    assert [a.shape for a in args["attention"]] == [torch.Size([1, n_heads, t, t])] * n_layers
    with pytest.raises(QkvError, match="at most 32"):
        attention_map(tiny_run, "x" * 40)


def test_attention_maps_of_model_objects(tmp_path: Path) -> None:
    lm = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=20, n_layers=2, d_model=16, n_heads=2,
                             max_positions=16)).eval()
    r = decoder_attention_maps(lm, [1, 2, 3, 4], list("abcd"))
    assert [m.weights.shape for m in r.maps] == [(2, 4, 4)] * 2
    cfg = model_cfg(TransformerConfig, src_vocab_size=11, tgt_vocab_size=13, d_model=16, n_heads=2, d_ff=32,
                    dropout=0.0,
                    n_encoder_layers=2, n_decoder_layers=1, max_positions=16)  # fmt: skip
    r = transformer_attention_maps(Transformer(cfg).eval(), [1, 2, 3, 4, 5], [1, 2, 3], list("abcde"), list("xyz"))
    shapes = {(m.kind, m.layer): m.weights.shape for m in r.maps}
    assert shapes == {("encoder", 0): (2, 5, 5), ("encoder", 1): (2, 5, 5), ("decoder", 0): (2, 3, 3),
                      ("cross", 0): (2, 3, 5)}  # fmt: skip
    assert np.all(np.triu(r.maps[2].weights, k=1) == 0)  # decoder self-attention is causal
    bv = r.to_bertviz()
    assert set(bv) == {"encoder_attention", "decoder_attention", "cross_attention", "encoder_tokens", "decoder_tokens"}
    assert np.array(bv["cross_attention"]).shape == (1, 1, 2, 3, 5)
    assert len(plot_layers(r, tmp_path)) == 4


# -------------------------------------------------------------------------------------------------- figures


def _assert_labelled(fig: Any) -> None:
    """Every visible plotting axes has a title and both axis labels (colour bars excluded)."""
    axes = [
        ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>" and not hasattr(ax, "_colorbar")
    ]
    assert axes
    for ax in axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), (ax.get_title(), ax.get_xlabel())


def test_every_figure_has_title_and_axis_labels(tiny_run: Path) -> None:
    from qkv.lab.attention_map import plot as plot_attention
    from qkv.lab.heads import plot as plot_heads
    from qkv.lab.masks import plot as plot_masks
    from qkv.lab.norms import plot as plot_norms
    from qkv.lab.positional import plot as plot_positional
    from qkv.lab.softmax import plot as plot_softmax
    from qkv.lab.variance import plot as plot_variance
    from qkv.lab.walkthrough import plot as plot_walkthrough

    # path=None builds the same Figure without drawing a PNG (the command-line test checks the PNGs).
    words, emb = builtin_example("river")
    figures = [
        plot_variance(variance(trials=200), None),
        plot_softmax(softmax(trials=20), None),
        plot_walkthrough([walkthrough(words, emb, "bank"), walkthrough(words, emb, "river")], None),
        plot_walkthrough(trainable_walkthrough(), None),
        plot_positional(positional(max_len=40, offsets=(1, 5)), None),
        plot_norms(norms(repeats=3, timing_reps=1), None),
        plot_masks(masks(), None),
        plot_heads(heads(d_model=64), None),
        plot_attention(attention_map(tiny_run, "To be"), None),
    ]
    for fig in figures:
        _assert_labelled(fig)


# ------------------------------------------------------------------------------------------ command line


def test_every_lab_command_prints_a_table_and_writes_a_png(tmp_path: Path, tiny_run: Path) -> None:
    commands = {name: ["lab", name, "--out", str(tmp_path / name)] for name in EXPERIMENTS}
    commands["attention-map"] = ["lab", "attention-map", str(tiny_run), "--text", "To be", "--out",
                                 str(tmp_path / "attention-map")]  # fmt: skip
    with ThreadPoolExecutor(max_workers=4) as pool:  # processes, four at a time: most of their time is imports
        results = dict(zip(commands, pool.map(lambda argv: _qkv(*argv, cwd=tmp_path), commands.values()), strict=True))
    for name, proc in results.items():
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert "---" in proc.stdout and "wrote " in proc.stdout, (name, proc.stdout[:500])
        pngs = sorted((tmp_path / name).glob("*.png"))
        assert pngs and all(_is_png(p) for p in pngs), (name, pngs)
    assert (tmp_path / "attention-map" / "attention-bertviz.json").is_file()


def _one_line_error(result: tuple[int, str, str], fragment: str) -> None:
    """Exit 2, nothing on stdout, one stderr line that contains `fragment`, no traceback."""
    code, out, err = result
    assert code == 2, (code, err)
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert fragment in err, err


def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    _one_line_error(run_main(capsys, "lab", "nosuch"), "invalid choice: 'nosuch'")
    _one_line_error(run_main(capsys, "lab", "walkthrough", "--embeddings", str(tmp_path / "missing.csv"),
                              "--query", "bank", "--out", out), "not found")  # fmt: skip
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("word,finance,nature\nbank,1,1\nriver,0,lots\n")
    _one_line_error(run_main(capsys, "lab", "walkthrough", "--embeddings", str(bad_csv), "--query", "bank",
                              "--out", out), "line 3: 'lots' is not a number")  # fmt: skip
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("bank,1,1\nriver,0\n")
    _one_line_error(run_main(capsys, "lab", "walkthrough", "--embeddings", str(ragged), "--query", "bank",
                              "--out", out), "same number")  # fmt: skip
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"words": ["bank", "river"], "embeddings": [[1, 1], [0, 2]')
    _one_line_error(run_main(capsys, "lab", "walkthrough", "--embeddings", str(bad_json), "--query", "bank",
                              "--out", out), "not valid JSON")  # fmt: skip
    good = tmp_path / "good.json"
    good.write_text('{"words": ["the", "river", "bank"], "embeddings": [[0, 0], [0, 2], [1, 1]], "dims": ["f", "n"]}')
    _one_line_error(run_main(capsys, "lab", "walkthrough", "--embeddings", str(good), "--query", "money",
                              "--out", out), "'money' is not in the sentence: the river bank")  # fmt: skip
    _one_line_error(run_main(capsys, "lab", "walkthrough", "--query", "cash", "--out", out), "not in the sentence")
    _one_line_error(run_main(capsys, "lab", "attention-map", str(tmp_path), "--out", out),
                    "is not a checkpoint: give a .gguf file")  # fmt: skip
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.png"))


def test_embeddings_files_csv_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_file = tmp_path / "e.csv"
    csv_file.write_text("# a comment\nword,finance,nature\nthe,0,0\nriver,0,2\n\nbank,1,1\n")
    words, emb, dims = load_embeddings(csv_file)
    assert words == ["the", "river", "bank"] and dims == ["finance", "nature"] and emb.shape == (3, 2)
    mapping = tmp_path / "e.json"
    mapping.write_text('{"the": [0, 0], "river": [0, 2], "bank": [1, 1]}')
    assert load_embeddings(mapping)[0] == words
    code, out, _ = run_main(capsys, "lab", "walkthrough", "--embeddings", str(csv_file), "--query", "bank",
                             "--no-scale", "--out", str(tmp_path / "o"))  # fmt: skip
    assert code == 0 and "score = q·k × 1" in out and _is_png(tmp_path / "o" / "walkthrough.png")


# ---------------------------------------------------------------------------------------------- the report


def test_report_opens_in_a_real_browser(tmp_path: Path, tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    browser = find_browser()  # before the work: a missing browser fails at once, with the reason
    out = tmp_path / "report"
    # In-process: the command-line test already runs every experiment as a real process.
    code, stdout, stderr = run_main(capsys, "lab", "report", "--run", str(tiny_run), "--out", str(out))
    assert code == 0, stderr
    assert "wrote " in stdout and "report.html" in stdout
    page = out / "report.html"
    html = page.read_text(encoding="utf-8")
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) >= 9 and all(_is_png(p) for p in pngs)
    assert html.count('src="data:image/png;base64,') == len(pngs)  # every figure embedded
    assert "http://" not in html and "https://" not in html  # nothing to fetch: works offline
    for name in (*EXPERIMENTS, "attention-map"):
        assert f'id="{name}"' in html

    driver = chrome(*browser)
    try:
        driver.get(page.as_uri())
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth]);"
        )
        severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        shot = tmp_path / "report-screenshot.png"
        assert driver.save_screenshot(str(shot))
    finally:
        driver.quit()
    assert severe == [], severe
    assert len(images) == len(pngs)
    assert all(complete and width > 0 for _, complete, width in images), images
    assert _is_png(shot)
