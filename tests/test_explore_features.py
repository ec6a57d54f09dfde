"""`qkv explore`'s Features tab: an SAE run's latents, a latent's dashboard and steering, against qkv.sae.features.

The API's answers equal the Python API's (to 1e-5), the dashboard's top contexts fill batch by batch as a
background job, every bad request is a one-line 4xx; then the page in headless Chromium shows those same numbers
(data- attributes carry the exact values behind the rounded text), steering changes the generation, and the page
asks nothing of any other host. Set QKV_EXPLORE_SHOTS to a directory to keep a screenshot of the tab there.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import explore_server, run_main
from test_explore import _request
from test_explore_browser import Page, opened_page, wait_for
from test_explore_inside import _api, _shot
from test_sae_task import HOOK, SAE, TINY

from qkv.cli import main
from qkv.data import load_shakespeare
from qkv.errors import QkvError
from qkv.explore import features
from qkv.explore.jobs import Jobs
from qkv.explore.library import RequestError
from qkv.sae.activations import read_activation
from qkv.sae.features import latents_of, promoted_tokens, steered, token_latents, top_contexts
from qkv.sae.measures import eval_windows
from qkv.tasks import load
from qkv.tasks.sae_open import SAEView, open_sae

TEXT = "To be, or not to be: that is the question"
PROMPT = "ROMEO:"
ALPHA = 40.0  # the tiny model's stream has a norm of a few units: this pushes it well off its course


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/lm: a 2-layer BPE model (vocab 300); data: Shakespeare prepared with its tokenizer; runs/sae: a TopK SAE
    (256 latents, k 32) on its layer-1 residual stream, 40 steps."""
    root = tmp_path_factory.mktemp("features")
    text = root / "excerpt.txt"
    text.write_text(load_shakespeare()[:60_000], encoding="utf-8")
    lm, data, sae = (str(root / p) for p in ("runs/lm", "data", "runs/sae"))
    assert main(["train", "--tokenizer", "bpe", "--vocab-size", "300", "--data", str(text), *TINY, "--max-steps",
                 "30", "--eval-interval", "30", "--out-dir", lm]) == 0  # fmt: skip
    assert main(["prepare", str(text), "--out", data, "--tokenizer", lm]) == 0
    assert main(["interpret", "sae", "train", lm, "--data", data, "--hook", HOOK, *SAE, "--max-steps", "40",
                 "--eval-interval", "40", "--out-dir", sae]) == 0  # fmt: skip
    return root


@pytest.fixture(scope="module")
def view(root: Path) -> SAEView:
    """The SAE as the Python API opens it."""
    return open_sae(root / "runs" / "sae")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Any]:
    """The explorer serving root/runs, as a real process."""
    with explore_server(root, "--runs", "runs") as explorer:
        yield explorer


def _ids(view: SAEView, text: str) -> torch.Tensor:
    return torch.tensor([view.base.tokenizer.encode(text)])


def _expected_contexts(view: SAEView, latent: int, windows: int, top: int = 8) -> list[Any]:
    split = view.data.split("val")  # type: ignore[union-attr]
    found = eval_windows(split, view.block_size, min(windows, split.window_count(view.block_size)), 16)
    return top_contexts(view.base.model, view.sae, view.hook, found, latent, top, filters=view.filters)


def _assert_top_latents(rows: list[list[list[float]]], view: SAEView, text: str, top: int) -> None:
    """Each position's [latent, value] pairs are its `top` largest latents (latents_of), largest first, to 1e-5.

    Latents whose values differ by less than float noise may come in either order (the server's threads sum in
    another order), so each shown value is checked against the latent it names and against the top-k values."""
    latents = latents_of(view.base.model, view.sae, view.hook, _ids(view, text))[0]  # (T, d_sae)
    assert len(rows) == latents.shape[0]
    for row, full in zip(rows, latents, strict=True):
        want = full.topk(top).values
        want = want[want > 0]
        shown = torch.tensor([v for _, v in row])
        torch.testing.assert_close(shown, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(full[[int(latent) for latent, _ in row]], shown, atol=1e-5, rtol=0)


def _busiest(view: SAEView) -> int:
    """The latent most active on TEXT: one that surely fires in held-out text too."""
    return int(token_latents(view.base.model, view.sae, view.hook, _ids(view, TEXT), 1)[3][0][0])


def test_describe_names_the_model_and_hook(server: Any, root: Path) -> None:
    about = _api(server, "sae", {"run": "runs/sae"})
    assert about["hook"] == HOOK and about["latents"] == 256 and about["k"] == 32 and about["d_model"] == 32
    assert about["model"] == str((root / "runs" / "lm").resolve()) and about["architecture"] == "topk"
    scale = float(load(root / "runs" / "sae").model.input_scale)
    assert about["norm"] == pytest.approx(32**0.5 / scale, rel=1e-6)  # the activations' mean norm at the hook


def test_token_latents_are_the_python_apis(server: Any, view: SAEView) -> None:
    answer = _api(server, "features", {"run": "runs/sae", "text": TEXT, "top": 6, "hook": HOOK})
    assert answer["ids"] == _ids(view, TEXT)[0].tolist()
    _assert_top_latents(answer["latents"], view, TEXT, 6)
    assert answer["tokens"] == [view.base.tokenizer.decode([i]) for i in answer["ids"]]
    assert sum(len(row) for row in answer["latents"]) > len(answer["ids"])  # real latents, not empty rows
    ids = _ids(view, TEXT)
    assert answer["trained"] == view.filters.mask(ids, read_activation(view.base.model, view.hook, ids))[0].tolist()
    assert answer["trained"][0] is False and all(answer["trained"][1:])  # the first position is left out


def _finish(server: Any, job: str) -> tuple[dict[str, Any], list[int]]:
    """Poll a dashboard until it ends: its last answer and every `done` seen."""
    seen = []
    while True:
        answer = _api(server, "feature_status", {"job": job})
        seen.append(answer["done"])
        if answer["state"] != "running":
            return answer, seen


def test_dashboard_is_top_contexts_and_promoted_tokens(server: Any, view: SAEView) -> None:
    latent = _busiest(view)
    start = _api(server, "feature", {"run": "runs/sae", "latent": latent, "windows": 64, "hook": HOOK})
    assert start["total"] == 4 and start["windows"] == 64  # 64 windows in batches of 16
    up, down = promoted_tokens(view.base.model, view.sae, latent, 8)
    assert [i for i, *_ in start["promoted"]] == [i for i, _ in up]
    np.testing.assert_allclose([v for _, v, _ in start["demoted"]], [v for _, v in down], atol=1e-5, rtol=0)
    assert start["promoted"][0][2] == view.base.tokenizer.decode([up[0][0]])
    done, seen = _finish(server, start["job"])
    assert done["state"] == "done" and done["done"] == 4 and seen == sorted(seen)
    expected = _expected_contexts(view, latent, 64)
    assert len(done["contexts"]) == len(expected) > 0
    for got, want in zip(done["contexts"], expected, strict=True):
        assert (got["ids"], got["at"]) == (want.tokens, want.at)
        np.testing.assert_allclose([got["value"], *got["values"]], [want.value, *want.values], atol=1e-5, rtol=0)
    assert set(done["pieces"]) == {str(i) for c in expected for i in c.tokens}


def test_a_saelens_directory_opens_with_the_model_given(capsys: pytest.CaptureFixture[str], root: Path,
                                                        view: SAEView) -> None:  # fmt: skip
    """The run exported to SAELens's format opens with --lm and --data: its latents and top contexts are the run's
    (the same function); without --lm, or --lm with a qkv run, a one-line refusal before any server starts."""
    if not (root / "saelens" / "cfg.json").is_file():
        assert main(["interpret", "sae", "export", str(root / "runs" / "sae"), str(root / "saelens")]) == 0
    for argv, message in [(["saelens"], "is a SAELens SAE: give the model it reads with --lm MODEL"),
                          (["runs/sae", "--lm", "runs/lm"], "is no SAELens directory (no cfg.json)"),
                          (["--data", "data"], "--data goes with --lm"),
                          (["saelens", "--lm", "runs/none"], "runs/none"),
                          (["saelens", "--lm", "runs/lm", "--data", "runs/lm"], "runs/lm")]:  # fmt: skip
        code, _, err = run_main(capsys, "explore", "--no-browser", *[str(root / a) if "/" in a or a in ("saelens",
                                "data") else a for a in argv])  # fmt: skip
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    with explore_server(root, "saelens", "--lm", "runs/lm", "--data", "data", "--runs", "runs") as server:
        about = _api(server, "sae", {"run": "saelens"})
        assert (about["hook"], about["latents"], about["norm"]) == (HOOK, 256, None)  # SAELens keeps no norm
        answer = _api(server, "features", {"run": "saelens", "text": TEXT, "top": 6, "hook": HOOK})
        _assert_top_latents(answer["latents"], view, TEXT, 6)
        latent = _busiest(view)
        start = _api(server, "feature", {"run": "saelens", "latent": latent, "windows": 64, "hook": HOOK})
        done, _ = _finish(server, start["job"])
    expected = _expected_contexts(view, latent, 64)
    assert [(c["ids"], c["at"]) for c in done["contexts"]] == [(c.tokens, c.at) for c in expected] != []
    np.testing.assert_allclose([c["value"] for c in done["contexts"]], [c.value for c in expected], atol=1e-4, rtol=0)


def test_steering_changes_the_generation_as_the_python_api_does(server: Any, view: SAEView) -> None:
    latent = _busiest(view)
    answer = _api(server, "steer", {"run": "runs/sae", "latent": latent, "alpha": ALPHA, "prompt": PROMPT,
                                    "max_new_tokens": 12, "hook": HOOK})  # fmt: skip
    tokenizer = view.base.tokenizer
    want = [tokenizer.decode(steered(view.base.model, view.sae, view.hook, _ids(view, PROMPT), latent, a, 12,
                                     tokenizer.eos_id)) for a in (0.0, ALPHA)]  # fmt: skip
    assert [answer["plain"], answer["steered"]] == want
    assert answer["plain"] != answer["steered"]


BAD = [
    ("an unknown latent", "feature", {"latent": 256}, 400,
     "'latent' must be a whole number between 0 and 255, got 256"),
    ("a negative latent", "steer", {"latent": -1, "alpha": 1, "prompt": "To"}, 400,
     "'latent' must be a whole number between 0 and 255, got -1"),
    ("an empty latent", "feature", {"latent": ""}, 400, "'latent' must be a whole number between 0 and 255, got ''"),
    ("the wrong hook", "features", {"text": "To be", "hook": "decoder.layers.0.resid_pre"}, 400,
     f"this SAE reads {HOOK}, not 'decoder.layers.0.resid_pre'"),
    ("α not a number", "steer", {"latent": 0, "alpha": "lots", "prompt": "To"}, 400, "'alpha' must be a finite number"),
    ("an infinite α", "steer", {"latent": 0, "alpha": 1e400, "prompt": "To"}, 400, "'alpha' must be a finite number"),
    ("a huge α", "steer", {"latent": 0, "alpha": 1e9, "prompt": "To"}, 400, "'alpha' must be between"),
    ("an empty prompt", "steer", {"latent": 0, "alpha": 1, "prompt": ""}, 400, "the prompt is empty"),
    ("a prompt and tokens past the context", "steer", {"latent": 0, "alpha": 1, "prompt": "To be or",
                                                       "max_new_tokens": 128}, 400, "exceed the model's context"),
    ("an empty text", "features", {"text": ""}, 400, "the text is empty"),
    ("a text longer than the context", "features", {"text": "x y " * 40}, 400,
     "tokens long but the model reads at most 32; shorten it"),
    ("a lone surrogate", "features", {"text": "To \ud800"}, 400, "'text' holds a lone UTF-16 surrogate"),
    ("zero windows", "feature", {"latent": 0, "windows": 0}, 400, "'windows' must be a whole number"),
    ("an unknown dashboard", "feature_status", {"job": "0123abcd"}, 404, "no feature dashboard '0123abcd'"),
    ("a language model in the Features tab", "sae", {"run": "runs/lm"}, 400, "this view opens an SAE run"),
    ("an SAE in the lens", "lens", {"text": "To"}, 400, "this view opens a run of a model that reads text"),
    ("path traversal", "features", {"run": "../runs/sae", "text": "To"}, 403, "outside the directories"),
]  # fmt: skip


@pytest.mark.parametrize("what, route, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_a_one_line_4xx(server: Any, what: str, route: str, body: dict[str, Any], status: int,
                                         message: str) -> None:  # fmt: skip
    run = {"run": "runs/lm"} if route == "sae" else {"run": "runs/sae"}
    got, answer = _request(server.url + "api/" + route, {**run, **body})
    assert (got, type(answer)) == (status, dict), answer
    assert message in answer["error"] and "\n" not in answer["error"] and "Traceback" not in answer["error"]


def test_a_text_longer_than_the_saes_windows_is_refused(view: SAEView) -> None:
    """The SAE read windows of block_size tokens: a longer text would show latents of positions it never saw."""
    with pytest.raises(QkvError, match=r"^the text is 10 tokens long; this SAE \(trained on windows of 8 tokens\) "
                                       r"reads at most 8: shorten it$"):  # fmt: skip
        features._ids(dataclasses.replace(view, block_size=8), "To be, or not", "text")


def test_a_dashboard_stops_when_asked_and_frees_its_slot(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled between two batches, a dashboard ends "cancelled" with the contexts found so far, and the next
    one starts at once; a second one while the first runs waits, then gets a 429."""
    gate = threading.Semaphore(0)  # one permit a batch
    searched = features.searched_contexts

    def slow(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for found in searched(*args, **kwargs):
            assert gate.acquire(timeout=10)
            yield found

    monkeypatch.setattr(features, "searched_contexts", slow)
    run, jobs = load(root / "runs" / "sae"), Jobs("feature dashboard", wait_s=0.2)
    first = jobs.get(features.dashboard(run, 3, windows=64, jobs=jobs)["job"])
    with pytest.raises(RequestError) as busy:
        features.dashboard(run, 4, windows=64, jobs=jobs)
    assert busy.value.status == 429 and "another feature dashboard is being computed" in str(busy.value)
    gate.release()
    wait_for(lambda: first.done == 1, "the first batch")
    jobs.cancel(first.id)
    for _ in range(8):
        gate.release()
    wait_for(lambda: first.state != "running", "the dashboard to stop")
    assert first.state == "cancelled" and 1 <= first.done < 4 and "contexts" in first.snapshot()
    second = jobs.get(features.dashboard(run, 4, windows=64, jobs=jobs)["job"])
    wait_for(lambda: second.state == "done", "the next dashboard")
    assert second.done == 4


# -------------------------------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def page(root: Path) -> Iterator[Page]:
    """The tab in Chromium, opened at #features on runs/sae."""
    with opened_page(root, "runs/sae", "--runs", "runs", anchor="features", height=2000) as page:
        yield page


def _cells(page: Page, selector: str, *attributes: str) -> list[list[str]]:
    return list(page.js("return Array.from(document.querySelectorAll(arguments[0])).map(e => arguments[1].map("
                        "a => e.getAttribute(a)));", selector, list(attributes)))  # fmt: skip


def test_page_token_latents_are_the_python_apis(page: Page, view: SAEView) -> None:
    page.tab("features")
    wait_for(lambda: page.js("return document.getElementById('feat-info').dataset.hook") == HOOK, "the SAE to open")
    page.set_value("feat-text", TEXT)
    n = len(_ids(view, TEXT)[0])
    script = ("return Array.from(document.querySelectorAll('#feat-tokens tr[data-pos]')).map(tr => Array.from("
              "tr.querySelectorAll('button.latent')).map(b => [Number(b.dataset.latent), Number(b.dataset.value)]));")
    wait_for(lambda: page.js("return document.getElementById('feat-tokens').dataset.text") == TEXT, "the typed text")
    rows = page.js(script)
    assert len(rows) == n
    _assert_top_latents(rows, view, TEXT, 5)


def test_page_dashboard_fills_and_is_the_python_apis(page: Page, view: SAEView) -> None:
    page.tab("features")
    latent = _busiest(view)
    page.driver.find_element("css selector", f'#feat-tokens button.latent[data-latent="{latent}"]').click()
    wait_for(lambda: page.js("const e = document.getElementById('feat-progress-info'); return e.dataset.state === "
                             "'done' && e.dataset.latent === arguments[0];", str(latent)), "the dashboard")  # fmt: skip
    history = page.js("return document.getElementById('feat-progress').qkvHistory")
    total = history[-1][1]
    assert history[0][0] == 0 and history[-1][0] == total > 1, history
    expected = _expected_contexts(view, latent, 256)
    shown = _cells(page, "#feat-contexts li", "data-ids", "data-at", "data-value", "data-values")
    assert len(shown) == len(expected) > 0
    for (ids, at, value, values), want in zip(shown, expected, strict=True):
        assert ([int(i) for i in ids.split(",")], int(at)) == (want.tokens, want.at)
        np.testing.assert_allclose([float(value), *map(float, values.split(","))], [want.value, *want.values],
                                   atol=1e-5, rtol=0)  # fmt: skip
    up, down = promoted_tokens(view.base.model, view.sae, latent, 8)
    promoted = [(int(i), float(v)) for i, v in _cells(page, "#feat-promoted tr[data-id]", "data-id", "data-value")]
    assert [i for i, _ in promoted] == [i for i, _ in up + down]
    np.testing.assert_allclose([v for _, v in promoted], [v for _, v in up + down], atol=1e-5, rtol=0)


def test_page_steering_changes_the_generation(page: Page, view: SAEView) -> None:
    page.tab("features")
    latent = _busiest(view)
    page.set_value("feat-latent", latent)
    for element_id, value in (("steer-alpha", ALPHA), ("steer-prompt", PROMPT), ("steer-tokens", 12)):
        page.set_value(element_id, value)
    page.driver.find_element("id", "steer-run").click()
    steered_text = wait_for(lambda: page.js("return document.getElementById('steer-steered').dataset.text"),
                            "the steered text")  # fmt: skip
    plain = page.js("return document.getElementById('steer-plain').dataset.text")
    tokenizer = view.base.tokenizer
    want = [tokenizer.decode(steered(view.base.model, view.sae, view.hook, _ids(view, PROMPT), latent, a, 12,
                                     tokenizer.eos_id)) for a in (0.0, ALPHA)]  # fmt: skip
    assert [plain, steered_text] == want and plain != steered_text
    _shot(page, "features", "features")
    page.set_value("steer-alpha", "lots")  # not a number: refused, and the page says why
    page.driver.find_element("id", "steer-run").click()
    wait_for(lambda: "'alpha' must be a finite number" in page.texts("#status")[0], "the refusal in the status line")


def test_the_tab_logs_no_error_and_asks_only_its_server(page: Page) -> None:
    page.tab("features")
    page.assert_clean("steer", "feature_status")  # the test asked for that refusal
