"""`qkv interpret sae train` / `qkv train sae` through the one loop, on a tiny BPE model: the run directory,
bit-identical resume, `qkv eval`, the SAELens export, `qkv interpret features` against the Python API, the
activation stream, a planted feature, and every bad input in one line."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_main
from safetensors.torch import load_file

from qkv.cli import main
from qkv.data import load_shakespeare
from qkv.data.tokens import open_data
from qkv.errors import QkvError
from qkv.sae import SAEConfig, load_saelens, save_saelens
from qkv.sae.activations import ActivationStream, Filters, geometric_median, read_activation
from qkv.sae.cache import CachedStream, write_cache
from qkv.sae.features import latents_of, token_latents, top_contexts
from qkv.sae.measures import eval_windows, sae_measures
from qkv.tasks import load
from qkv.tasks.sae import filters_of
from qkv.tasks.sae_open import open_sae

TINY = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--block-size", "32", "--batch-size", "4",
        "--sample-tokens", "0", "--device", "cpu"]  # fmt: skip
SAE = ["--batch-size", "256", "--buffer-tokens", "1000", "--block-size", "32", "--warmup-steps", "2",
       "--eval-windows", "16", "--device", "cpu"]  # fmt: skip
HOOK = "decoder.layers.1.resid_pre"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 6-step BPE model (vocab 300) and the same text prepared with its tokenizer."""
    root = tmp_path_factory.mktemp("sae")
    text = root / "excerpt.txt"
    text.write_text(load_shakespeare()[:60_000], encoding="utf-8")
    assert main(["train", "--tokenizer", "bpe", "--vocab-size", "300", "--data", str(text), *TINY, "--max-steps",
                 "6", "--eval-interval", "6", "--out-dir", str(root / "base")]) == 0  # fmt: skip
    assert main(["prepare", str(text), "--out", str(root / "data"), "--tokenizer", str(root / "base")]) == 0
    return {"root": root, "text": text, "base": root / "base", "data": root / "data"}


def _train(capsys: pytest.CaptureFixture[str], world: dict[str, Path], out: Path, *extra: str) -> tuple[int, str, str]:
    return run_main(capsys, "interpret", "sae", "train", str(world["base"]), "--data", str(world["data"]), "--hook",
                    HOOK, *SAE, "--out-dir", str(out), *extra)  # fmt: skip


@pytest.fixture(scope="module")
def sae_run(world: dict[str, Path]) -> Path:
    """A 12-step TopK SAE on the tiny model's layer-1 residual stream."""
    out = world["root"] / "sae"
    assert main(["interpret", "sae", "train", str(world["base"]), "--data", str(world["data"]), "--hook", HOOK, *SAE,
                 "--max-steps", "12", "--eval-interval", "6", "--out-dir", str(out)]) == 0  # fmt: skip
    return out


def test_a_run_records_where_the_sae_belongs(sae_run: Path, world: dict[str, Path]) -> None:
    """config.json: the model's reference (path, sha256), the hook, the data and the filters; the SAE's weights
    with its input scale (mean norm √d on the sample) and firing counts."""
    config = json.loads((sae_run / "config.json").read_text())
    assert config["task"] == "sae" and config["model_type"] == "sae"
    assert config["base"]["path"] == str(world["base"].resolve()) and len(config["base"]["sha256"]) == 64
    assert config["data"]["hook"] == HOOK
    assert config["data"]["filters"] == {"drop_first": True, "max_norm_ratio": 10.0}
    assert (config["model"]["d_model"], config["model"]["d_sae"], config["model"]["k"]) == (32, 256, 32)
    weights = load_file(sae_run / "model.safetensors")
    assert float(weights["input_scale"]) > 0 and weights["tokens_since_fired"].dtype == torch.int64
    metrics = [json.loads(line) for line in (sae_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [6, 12]
    assert "val_loss_recovered" in metrics[-1] and "val_loss_recovered" not in metrics[0]  # the last one only


def test_resume_is_bit_identical(capsys: pytest.CaptureFixture[str], world: dict[str, Path], tmp_path: Path) -> None:
    """Stopped after its first step (buffers of 1,000 rows, batches of 256: they straddle) and resumed, a run ends
    with the weights, firing counts and metrics of one that was never stopped."""
    assert _train(capsys, world, tmp_path / "straight", "--max-steps", "8", "--eval-interval", "4")[0] == 0
    assert _train(capsys, world, tmp_path / "split", "--max-steps", "8", "--eval-interval", "4",
                  "--max-time", "1e-9")[0] == 0  # fmt: skip
    code, _, err = run_main(capsys, "train", "sae", "--resume", "--out-dir", str(tmp_path / "split"), "--max-time",
                            "none")  # fmt: skip
    assert code == 0, err
    straight, split = (load_file(tmp_path / d / "last.safetensors") for d in ("straight", "split"))
    assert straight.keys() == split.keys() and all(torch.equal(straight[k], split[k]) for k in straight)
    logged = [[{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
               for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("straight", "split")]
    assert logged[0][-1] == logged[1][-1] and logged[0][-1]["step"] == 8  # (the stopped run also logged step 1)


def test_a_run_on_cached_activations_equals_one_that_computes_them(
    capsys: pytest.CaptureFixture[str], world: dict[str, Path], tmp_path: Path
) -> None:
    """`qkv interpret sae cache` writes the stream's buffers; a run with --activations ends with the weights of a run
    without. A cache too short for the run, or of another hook, is refused before training, in one line."""
    code, _, err = run_main(capsys, "interpret", "sae", "cache", str(world["base"]), "--data", str(world["data"]),
                              "--tokens", "2500", "--out", str(tmp_path / "cache"), "--buffer-tokens", "1000",
                              "--block-size", "32", "--hook", HOOK)  # fmt: skip
    assert code == 0, err
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert files == [f"buffer-0000{i}.safetensors" for i in range(3)] + ["meta.json"]
    assert _train(capsys, world, tmp_path / "computed", "--max-steps", "8", "--eval-interval", "8")[0] == 0
    assert _train(capsys, world, tmp_path / "cached", "--max-steps", "8", "--eval-interval", "8", "--activations",
                  str(tmp_path / "cache"))[0] == 0  # fmt: skip
    computed, cached = (load_file(tmp_path / d / "last.safetensors") for d in ("computed", "cached"))
    assert all(torch.equal(computed[k], cached[k]) for k in computed)
    code, _, err = _train(capsys, world, tmp_path / "long", "--max-steps", "20", "--activations",
                          str(tmp_path / "cache"))  # fmt: skip
    assert code == 2 and "cache more or lower --max-steps" in err and not (tmp_path / "long").exists()
    code, _, err = run_main(capsys, "interpret", "sae", "train", str(world["base"]), "--data", str(world["data"]),
                            *SAE, "--hook", "decoder.layers.0.resid_pre", "--max-steps", "2", "--activations",
                            str(tmp_path / "cache"), "--out-dir", str(tmp_path / "other"))  # fmt: skip
    assert code == 2 and "hook differ" in err, err


def test_eval_reports_the_measures_of_the_python_api(capsys: pytest.CaptureFixture[str], sae_run: Path,
                                                     world: dict[str, Path]) -> None:  # fmt: skip
    """`qkv eval SAE_RUN` prints sae_measures' numbers on the run's held-out windows; the loss with the SAE lies
    between the clean one and the zero-ablated one's neighbourhood, and FVU is in (0, 1)."""
    code, out, err = run_main(capsys, "eval", str(sae_run))
    assert code == 0, err
    run = load(sae_run)
    base, hook, data = run.subject()
    m = sae_measures(base.model, run.model, hook, eval_windows(data.split("val"), 32, 16), filters_of(run.config, base))
    final = json.loads((sae_run / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["val_fvu"] == pytest.approx(m["fvu"], rel=1e-6)  # the run's last evaluation measured the same
    assert f"FVU {m['fvu']:.4f}" in out and f"L0 {m['l0']:.1f}" in out
    assert f"loss recovered {m['loss_recovered']:.1%}" in out
    assert 0 < m["fvu"] < 1 and m["loss_zero"] > m["loss_clean"]
    assert m["l0"] == pytest.approx(32, abs=1e-6)
    fired = torch.zeros(run.model.cfg.latents, dtype=torch.bool)  # latents firing on some kept held-out row
    for ids, _ in eval_windows(data.split("val"), 32, 16):
        acts = read_activation(base.model, hook, ids)
        with torch.no_grad():
            fired |= (run.model.encode(acts[filters_of(run.config, base).mask(ids, acts)]) > 0).any(0)
    assert m["unfired_share"] == pytest.approx(1 - float(fired.float().mean()), abs=1e-9)
    assert f"{m['unfired_share']:.1%} never fired here" in out


def test_the_export_loads_as_the_runs_folded_sae(capsys: pytest.CaptureFixture[str], sae_run: Path,
                                                 world: dict[str, Path], tmp_path: Path) -> None:  # fmt: skip
    """`qkv interpret sae export` writes SAELens's format with the hook and model in its metadata; read back, it
    computes what the run's SAE computes. An existing directory is refused."""
    assert run_main(capsys, "interpret", "sae", "export", str(sae_run), str(tmp_path / "sl"))[0] == 0
    sae, metadata = load_saelens(tmp_path / "sl")
    run = load(sae_run)
    x = torch.randn(20, 32) * 3
    torch.testing.assert_close(sae(x), run.model(x), atol=1e-5, rtol=1e-5)
    assert metadata["hook_name"] == HOOK and len(metadata["qkv"]["model"]["sha256"]) == 64
    code, _, err = run_main(capsys, "interpret", "sae", "export", str(sae_run), str(tmp_path / "sl"))
    assert code == 2 and "already exists" in err
    lm, data = str(world["base"]), str(world["data"])
    assert open_sae(tmp_path / "sl", lm, data).filters == open_sae(sae_run).filters  # the filters it was trained with
    cfg = json.loads((tmp_path / "sl" / "cfg.json").read_text())
    cfg["metadata"]["qkv"]["filters"] = {"drop_first": False, "max_norm_ratio": None}
    (tmp_path / "sl" / "cfg.json").write_text(json.dumps(cfg))
    filters = open_sae(tmp_path / "sl", lm, data).filters
    assert (filters.drop_first, filters.max_norm_ratio) == (False, None)


def test_features_on_the_command_line_equal_the_api(capsys: pytest.CaptureFixture[str], sae_run: Path) -> None:
    """--text prints token_latents' latents; --latent prints its contexts with the activating token marked;
    --steer changes the continuation; --random draws the latents it names."""
    view = open_sae(sae_run)
    ids = view.base.tokenizer.encode_tensor("ROMEO: what light")[None, :]
    expected = token_latents(view.base.model, view.sae, view.hook, ids, 3)
    code, out, err = run_main(capsys, "interpret", "features", str(sae_run), "--text", "ROMEO: what light", "--top",
                              "3")  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == ids.shape[1]
    for line, latents in zip(lines, expected, strict=True):
        assert line.endswith("  ".join(f"{latent}:{value:.3g}" for latent, value in latents))
    code, out, err = run_main(capsys, "interpret", "features", str(sae_run), "--latent", "3", "--windows", "32")
    assert code == 0 and "⟦" in out and "promotes:" in out, err
    code, out, err = run_main(capsys, "interpret", "features", str(sae_run), "--latent", "3", "--steer", "200",
                              "--prompt", "ROMEO:", "--max-new-tokens", "8")  # fmt: skip
    plain, steered = (line.split(": ", 1)[1] for line in out.splitlines()[-2:])
    assert code == 0 and plain != steered
    code, out, _ = run_main(capsys, "interpret", "features", str(sae_run), "--random", "2", "--windows", "16")
    assert code == 0 and out.count("top ") == 2


@pytest.mark.parametrize(("extra", "message"), [
    (["--hook", "decoder.layers.9.resid_pre"], "unknown hook name"),
    (["--hook", "decoder.layers.0.attn.z"], "an SAE reads one vector per position"),
    (["--compile"], "--compile is not supported"),
    (["--model", "k=9999"], "k = 9999 is more than the 256 latents; lower it (--model k=…)"),
    (["--model", "n_layers=3"], "unknown model setting 'n_layers'; the model's fields: architecture, "),
    (["--n-layers", "3"], "unrecognized arguments: --n-layers 3"),
    (["--nproc", "2"], "`qkv train sae` trains on one process: drop --nproc"),
])  # fmt: skip
def test_bad_input_is_refused_in_one_line(capsys: pytest.CaptureFixture[str], world: dict[str, Path], tmp_path: Path,
                                          extra: list[str], message: str) -> None:  # fmt: skip
    code, _, err = _train(capsys, world, tmp_path / "bad", "--max-steps", "2", *extra)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_dashboards_leave_out_the_positions_training_left_out(sae_run: Path) -> None:
    """The latent most active at a window's first position (the attention sink) tops its own dashboard there;
    with the run's filters that position counts as 0, and no context is at a window's start (at == 0 iff so)."""
    view = open_sae(sae_run)
    windows = list(eval_windows(view.data.split("val"), 32, 16, 16))  # type: ignore[union-attr]
    latents = latents_of(view.base.model, view.sae, view.hook, windows[0][0])  # (B, T, d_sae)
    latent = int(latents[:, 0].amax(0).argmax())
    plain = top_contexts(view.base.model, view.sae, view.hook, windows, latent, 4)
    assert plain[0].at == 0  # the sink's outsized activation wins when nothing is left out
    kept = top_contexts(view.base.model, view.sae, view.hook, windows, latent, 4, filters=view.filters)
    assert kept and all(c.at > 0 for c in kept) and kept[0].value < plain[0].value


def test_help_offers_only_the_saes_own_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "interpret", "sae", "train", "--help")
    assert code == 0 and "--model KEY=VALUE" in out and "dead_window" in out and "--buffer-tokens" in out
    assert not any(flag in out for flag in ("--n-layers", "--d-model", "--n-heads", "--dropout", "--nproc")), out


def test_data_of_another_tokenizer_and_bad_views_are_refused(
    capsys: pytest.CaptureFixture[str], sae_run: Path, world: dict[str, Path], tmp_path: Path
) -> None:
    assert main(["prepare", str(world["text"]), "--out", str(tmp_path / "other"), "--tokenizer", "bpe",
                 "--vocab-size", "280"]) == 0  # fmt: skip
    code, _, err = run_main(capsys, "interpret", "sae", "train", str(world["base"]), "--data", str(tmp_path / "other"),
                            *SAE, "--max-steps", "2", "--out-dir", str(tmp_path / "x"))  # fmt: skip
    assert code == 2 and "another tokenizer" in err
    for argv, message in [(["--latent", "99999"], "does not exist"), (["--text", "a", "--latent", "1"], "one of"),
                          (["--latent", "1", "--steer", "2"], "go together"),
                          (["--random", "0"], "must be ≥ 1"),
                          (["--latent", "1", "--steer", "nan", "--prompt", "To"], "α must be a finite number"),
                          (["--latent", "1", "--steer", "1e30", "--prompt", "To"], "between -10000 and 10000"),
                          (["--latent", "1", "--steer", "2", "--prompt", ""], "--prompt is empty"),
                          (["--text", ""], "--text is empty"),
                          (["--text", "x y " * 40], "but the model reads at most 32; shorten it")]:  # fmt: skip
        code, _, err = run_main(capsys, "interpret", "features", str(sae_run), *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_main(capsys, "interpret", "features", str(sae_run), "--latent", "nan")
    assert code == 2 and "invalid int value" in err


def test_the_stream_is_a_function_of_seed_and_position(world: dict[str, Path]) -> None:
    """Rows read in any pieces equal rows read at once; another seed reads other rows; the first position of each
    window is dropped."""
    base = load(world["base"]).model
    split = open_data(world["data"]).split("train")
    stream = ActivationStream(base, HOOK, split, 32, Filters(max_norm_ratio=None), 300, seed=5)
    whole = stream.rows(0, 900)
    pieces = torch.cat([ActivationStream(base, HOOK, split, 32, Filters(max_norm_ratio=None), 300, 5).rows(a, b - a)
                        for a, b in [(0, 7), (7, 450), (450, 900)]])  # fmt: skip
    assert torch.equal(whole, pieces) and whole.shape == (900, 32)
    other = ActivationStream(base, HOOK, split, 32, Filters(max_norm_ratio=None), 300, seed=6).rows(0, 900)
    assert not torch.equal(whole, other)
    ids, _ = split.windows(torch.tensor([0]), 32)
    assert Filters().mask(ids, torch.ones(1, 32, 4))[0].tolist() == [False] + [True] * 31


def test_the_geometric_median_beats_the_mean_on_outliers() -> None:
    """Weiszfeld's median stays with the bulk when a few points are far away, and equals a known median."""
    points = torch.cat([torch.randn(200, 3) * 0.1, torch.full((10, 3), 100.0)])
    assert geometric_median(points).norm() < 0.1 < points.mean(0).norm()
    square = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    torch.testing.assert_close(geometric_median(square), torch.tensor([1.0, 1.0]))


@pytest.mark.slow
def test_a_planted_token_is_recovered_by_one_latent(tmp_path: Path) -> None:
    """Text with a made-up phrase, " zyx qrv", planted after 6 % of its words (" zyx" is one BPE token, 1 % of the
    tokens): a small model (2 layers, width 128) learns that " zyx" predicts " qrv", and an SAE on its layer-1
    residual stream has one latent that fires on " zyx" with precision ≥ 0.9 and recall ≥ 0.9. (Planted alone,
    predicting nothing, " zyx" shares its best latent with other tokens: the model has no use for its own direction.)"""
    rng = random.Random(0)
    words = load_shakespeare()[:80_000].split(" ")
    planted = " ".join(w if rng.random() > 0.06 else f"{w} zyx qrv" for w in words)
    (tmp_path / "text.txt").write_text(planted, encoding="utf-8")
    model = ["--n-layers", "2", "--d-model", "128", "--n-heads", "4", "--block-size", "32", "--batch-size", "16",
             "--sample-tokens", "0", "--device", "cpu"]  # fmt: skip
    assert main(["train", "--tokenizer", "bpe", "--vocab-size", "300", "--data", str(tmp_path / "text.txt"), *model,
                 "--max-steps", "300", "--eval-interval", "300", "--out-dir", str(tmp_path / "lm")]) == 0  # fmt: skip
    assert main(["prepare", str(tmp_path / "text.txt"), "--out", str(tmp_path / "data"), "--tokenizer",
                 str(tmp_path / "lm")]) == 0  # fmt: skip
    assert main(["interpret", "sae", "train", str(tmp_path / "lm"), "--data", str(tmp_path / "data"), "--hook", HOOK,
                 *SAE, "--model", "k=8", "--model", "expansion=4", "--max-steps", "400", "--eval-interval", "400",
                 "--lr", "1e-3", "--out-dir", str(tmp_path / "sae")]) == 0  # fmt: skip
    view = open_sae(tmp_path / "sae")
    marker = view.base.tokenizer.encode(" zyx")
    fired, hits = [], []
    assert view.data is not None
    for ids, _ in eval_windows(view.data.split("val"), 32, 400, 16):
        latents = token_latents_batch(view, ids)  # (B, T, d_sae)
        is_planted = planted_positions(ids, marker)  # (B, T)
        fired.append(latents[:, 1:].flatten(0, 1) > 0)
        hits.append(is_planted[:, 1:].flatten())
    active, truth = torch.cat(fired), torch.cat(hits)
    precision = (active & truth[:, None]).sum(0) / active.sum(0).clamp_min(1)
    recall = (active & truth[:, None]).sum(0) / truth.sum()
    best = int((precision * recall).argmax())
    assert truth.sum() > 100, int(truth.sum())
    assert precision[best] >= 0.9 and recall[best] >= 0.9, (float(precision[best]), float(recall[best]))


def token_latents_batch(view: object, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, d_sae) latents of a batch of windows."""
    from qkv.sae.features import latents_of

    return latents_of(view.base.model, view.sae, view.hook, ids)  # type: ignore[attr-defined]


def planted_positions(ids: torch.Tensor, marker: list[int]) -> torch.Tensor:
    """(B, T) bool: the last token of each occurrence of the marker's ids."""
    out = torch.zeros(ids.shape, dtype=torch.bool)
    n = len(marker)
    for b in range(ids.shape[0]):
        row = ids[b].tolist()
        for t in range(n - 1, len(row)):
            if row[t - n + 1 : t + 1] == marker:
                out[b, t] = True
    return out


def test_open_sae_refuses_what_does_not_fit(sae_run: Path, tmp_path: Path, world: dict[str, Path]) -> None:
    """A SAELens directory without --lm, an SAE run given --lm, and an SAE of another width."""
    assert main(["interpret", "sae", "export", str(sae_run), str(tmp_path / "sl")]) == 0
    with pytest.raises(QkvError, match="give the model it reads with --lm"):
        open_sae(tmp_path / "sl")
    with pytest.raises(QkvError, match="drop --lm and --data"):
        open_sae(sae_run, lm=str(world["base"]))
    narrow = SAEConfig(d_model=16, d_sae=64).build()
    save_saelens(narrow, tmp_path / "narrow", {"hook_name": HOOK})
    with pytest.raises(QkvError, match="belongs to another model"):
        open_sae(tmp_path / "narrow", lm=str(world["base"]))


def test_an_sae_reads_only_the_weights_it_was_trained_on(capsys: pytest.CaptureFixture[str], sae_run: Path,
                                                         tmp_path: Path) -> None:  # fmt: skip
    """A run whose model has changed since (its recorded sha256 differs) or is gone is refused in one line."""
    moved = tmp_path / "sae"
    shutil.copytree(sae_run, moved)
    config = json.loads((moved / "config.json").read_text())
    config["base"]["sha256"] = "0" * 64
    (moved / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, "eval", str(moved))
    assert code == 2 and err.count("\n") == 1
    assert f"is an SAE of {config['base']['path']}, whose weights have changed since" in err
    assert "the run was trained on 000000000000…); restore that model, or train the SAE again on this one" in err
    config["base"]["path"] = str(tmp_path / "gone.gguf")
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(QkvError, match=r"is an SAE of .*gone.gguf, which is gone; put the model back there"):
        open_sae(moved)


def test_a_cache_is_never_mixed_or_read_unfinished(world: dict[str, Path], tmp_path: Path) -> None:
    """meta.json is written before the first buffer: a second cache of other settings into the same directory is
    refused, so is a directory of other files, and an unfinished cache is not read."""
    base = load(world["base"]).model
    split = open_data(world["data"]).split("train")
    about = {"hook": HOOK, "filters": {}, "model": {}, "data": {}}
    stream = ActivationStream(base, HOOK, split, 32, Filters(), 300, seed=1)
    write_cache(stream, 600, tmp_path / "c", about)
    assert CachedStream(tmp_path / "c").total == 600
    other = ActivationStream(base, HOOK, split, 32, Filters(), 300, seed=2)
    with pytest.raises(QkvError, match="another model, hook, data or stream"):
        write_cache(other, 600, tmp_path / "c", about)
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    (tmp_path / "c" / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(QkvError, match="unfinished cache"):
        CachedStream(tmp_path / "c")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(QkvError, match="not empty"):
        write_cache(stream, 300, tmp_path / "junk", about)
