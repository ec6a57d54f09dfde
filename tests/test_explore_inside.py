"""`qkv explore`'s "inside the model" panel: the logit lens, activation patching and induction heads.

The API's numbers against qkv.interpret's (to 1e-5), a one-line 4xx for every bad request, the patching map
filling layer by layer and the cap on maps computed at once; then the page in headless Chromium: what it
shows (data- attributes carry the exact values behind the rounded text) is what qkv.interpret computes.
Set QKV_EXPLORE_SHOTS to a directory to keep a screenshot of each view there.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import explore_server, tiny_settings
from test_explore import _request
from test_explore_browser import Page, opened_page, wait_for

from qkv.explore.inside import ordinary_range
from qkv.explore.library import RequestError
from qkv.explore.patch_jobs import PatchJobs
from qkv.interpret import activation_patching, head_scores, logit_lens, repeated_tokens
from qkv.tasks import load, train

LENS_TEXT = "To be, or not"
CLEAN, CORRUPTED = "To be, or not to be: that is the", "To be, or not to be: that is thy"  # 32 characters


@pytest.fixture(scope="module")
def root(explore_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's runs (lm: 2 layers × 2 heads; mlm; tr), a post-norm lm without a final norm, and "slow": an
    8-layer lm whose patching map takes a second or two, so that it can be watched filling."""
    root = tmp_path_factory.mktemp("inside")
    for name in ("lm", "mlm", "tr"):
        shutil.copytree(explore_root / "runs" / name, root / "runs" / name)
    data = {"text": root / "excerpt.txt", "pairs": root / "pairs.tsv"}
    shutil.copy(explore_root / "data" / "excerpt.txt", data["text"])
    for name, model, extra in (("post", {"n_layers": 2, "norm_placement": "post"}, {}),
                               ("slow", {"n_layers": 8, "d_model": 256, "n_heads": 4},
                                {"block_size": 128, "max_steps": 2, "eval_tokens": 256})):  # fmt: skip
        settings = {**tiny_settings("lm", data), **extra}
        settings["model"] = {**settings["model"], **model}
        train(task="lm", verbose=False, **settings, out_dir=str(root / "runs" / name))
    return root


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Any]:
    """The explorer serving root/runs, as a real process."""
    with explore_server(root, "--runs", "runs") as explorer:
        yield explorer


def _api(server: Any, route: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = _request(server.url + "api/" + route, body)
    assert status == 200, answer
    result: dict[str, Any] = answer
    return result


def _ids(run: Any, text: str) -> torch.Tensor:
    return torch.tensor([run.require_tokenizer().encode(text)])


def _finish(server: Any, job: str) -> tuple[dict[str, Any], list[tuple[int, int, int]]]:
    """Poll a patching map until it ends: its last answer and every (done, resid rows, heads rows) seen."""
    seen = []
    while True:
        answer = _api(server, "patching_status", {"job": job})
        seen.append((answer["done"], len(answer["resid"]), len(answer["heads"])))
        if answer["state"] != "running":
            return answer, seen


# ------------------------------------------------------------------------------------------- the API


@pytest.mark.parametrize("name", ["lm", "mlm", "post"])
def test_lens_is_qkv_interpret_logit_lens(server: Any, root: Path, name: str) -> None:
    run = load(root / "runs" / name)
    answer = _api(server, "lens", {"run": f"runs/{name}", "text": LENS_TEXT})
    lens = logit_lens(run.model, _ids(run, LENS_TEXT))
    probs, top = lens.top(5)
    np.testing.assert_allclose(answer["top_probs"], probs[:, 0].numpy(), atol=1e-5, rtol=0)
    assert answer["top_ids"] == top[:, 0].tolist() and answer["labels"] == lens.labels
    tokenizer = run.require_tokenizer()
    assert answer["note"] == lens.note and answer["tokens"] == [tokenizer.decode([i]) for i in _ids(run, LENS_TEXT)[0]]
    assert answer["final_norm"] == (name != "post")  # no final norm is no error: the note says what is used
    if name == "post":
        assert "no final norm" in answer["note"] and "output head to each stream directly" in answer["note"]
    assert set(answer["pieces"]) == {str(i) for i in top[:, 0].flatten().tolist()}


@pytest.mark.parametrize("name, body", [("lm", {}), ("lm", {"seed": 3, "length": 9, "batch": 2}), ("mlm", {})])
def test_head_scores_are_qkv_interpret_head_scores(server: Any, root: Path, name: str, body: dict[str, Any]) -> None:
    run = load(root / "runs" / name)
    answer = _api(server, "heads", {"run": f"runs/{name}", **body})
    length = body.get("length", 16)  # 25 does not fit twice in the context of 32
    assert (answer["length"], answer["batch"], answer["seed"]) == (length, body.get("batch", 4), body.get("seed", 0))
    ids = repeated_tokens(answer["batch"], length, answer["high"], torch.Generator().manual_seed(answer["seed"]),
                          answer["low"])  # fmt: skip
    induction, previous = head_scores(run.model, ids, "decoder" if name == "lm" else "encoder")
    np.testing.assert_allclose(answer["induction"], induction.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(answer["previous"], previous.numpy(), atol=1e-5, rtol=0)
    best = induction.flatten().topk(len(answer["top"]))
    assert [t["layer"] * induction.shape[1] + t["head"] for t in answer["top"]] == best.indices.tolist()
    if name == "mlm":  # a BPE with <|endoftext|> (0) and <mask> (1): the repeated tokens are ordinary ones
        assert answer["low"] > 1 and answer["high"] == 300


def test_patching_map_is_qkv_interpret_activation_patching(server: Any, root: Path) -> None:
    run = load(root / "runs" / "lm")
    clean, corrupted = _ids(run, CLEAN[:20]), _ids(run, CORRUPTED[:19] + "u")
    started = _api(server, "patching", {"run": "runs/lm", "clean": CLEAN[:20], "corrupted": CORRUPTED[:19] + "u"})
    with torch.no_grad():  # no answer given: each prompt's most probable next token
        answer, wrong = int(run.model(clean)[0, -1].argmax()), int(run.model(corrupted)[0, -1].argmax())
    assert (started["answer"]["id"], started["wrong"]["id"]) == (answer, wrong)
    done, _ = _finish(server, started["job"])
    expected = activation_patching(run.model, clean, corrupted, answer, wrong)
    assert done["state"] == "done" and done["done"] == done["total"] == 4
    assert started["clean"] == pytest.approx(expected.clean, abs=1e-5)
    assert started["corrupted"] == pytest.approx(expected.corrupted, abs=1e-5)
    np.testing.assert_allclose(done["resid"], expected.resid.numpy(), atol=1e-5, rtol=0)
    assert expected.heads is not None
    np.testing.assert_allclose(done["heads"], expected.heads.numpy(), atol=1e-5, rtol=0)
    chosen = _api(server, "patching", {"run": "runs/lm", "clean": "To be", "corrupted": "To bo", "answer": ",",
                                       "wrong": " ", "heads": False})  # fmt: skip
    done, _ = _finish(server, chosen["job"])
    tokenizer = run.require_tokenizer()
    expected = activation_patching(run.model, _ids(run, "To be"), _ids(run, "To bo"), tokenizer.encode(",")[0],
                                   tokenizer.encode(" ")[0], heads=False)  # fmt: skip
    assert done["heads"] == [] and done["total"] == 2
    np.testing.assert_allclose(done["resid"], expected.resid.numpy(), atol=1e-5, rtol=0)


def test_patching_map_fills_layer_by_layer_and_can_be_stopped(server: Any, root: Path) -> None:
    run = load(root / "runs" / "slow")
    body = {"run": "runs/slow", "clean": CLEAN, "corrupted": CORRUPTED, "answer": "b", "wrong": "t"}
    done, seen = _finish(server, _api(server, "patching", body)["job"])
    assert done["state"] == "done" and done["total"] == 16
    assert any(0 < d < 16 for d, _, _ in seen), seen  # rows arrived while the map was computed
    assert seen == sorted(seen) and all(d == r + h and (h == 0 or r == 8) for d, r, h in seen)  # streams first
    tokenizer = run.require_tokenizer()
    expected = activation_patching(run.model, _ids(run, CLEAN), _ids(run, CORRUPTED), tokenizer.encode("b")[0],
                                   tokenizer.encode("t")[0])  # fmt: skip
    np.testing.assert_allclose(done["resid"], expected.resid.numpy(), atol=1e-5, rtol=0)
    assert expected.heads is not None
    np.testing.assert_allclose(done["heads"], expected.heads.numpy(), atol=1e-5, rtol=0)
    job = _api(server, "patching", body)["job"]
    assert _api(server, "patching_cancel", {"job": job})["job"] == job
    stopped, _ = _finish(server, job)
    assert stopped["state"] == "cancelled" and stopped["done"] < 16
    assert _finish(server, _api(server, "patching", body)["job"])[0]["state"] == "done"  # its slot was freed


def test_one_map_at_a_time_and_abandoned_maps_stop() -> None:
    jobs = PatchJobs(running=1, wait_s=0.2, abandoned_s=0.3)
    release = threading.Event()

    def rows() -> Iterator[tuple[str, int, list[float]]]:
        for i in range(3):
            release.wait(5)
            yield "resid", i, [float(i)]

    first = jobs.start_map(lambda: (3, rows()))
    with pytest.raises(RequestError) as busy:
        jobs.start_map(lambda: (3, rows()))
    assert busy.value.status == 429 and "another patching map" in str(busy.value)
    release.set()
    wait_for(lambda: jobs.get(first.id).state == "done", "the first map")
    assert jobs.get(first.id).snapshot()["resid"] == [[0.0], [1.0], [2.0]]
    release.clear()
    second = jobs.start_map(lambda: (3, rows()))  # the slot is free again
    time.sleep(0.5)  # nobody polls it
    release.set()
    wait_for(lambda: second.state != "running", "the abandoned map to stop")
    assert second.state == "cancelled" and len(second.view["resid"]) == 1
    with pytest.raises(RequestError) as unknown:
        jobs.get("nothing")
    assert unknown.value.status == 404


class _LateRelease:
    """A slot whose release runs late, as a worker thread that the scheduler puts off on a loaded machine."""

    def __init__(self, slots: Any) -> None:
        self.slots = slots

    def acquire(self, timeout: float) -> bool:
        return bool(self.slots.acquire(timeout=timeout))

    def release(self) -> None:
        time.sleep(0.6)  # longer than the start's wait for a slot
        self.slots.release()


def test_a_map_seen_ended_has_given_its_slot_back() -> None:
    """Whoever sees a map done starts the next at once, however late the worker thread finishes (this was flaky
    under load: the map said done before its slot was free, and the next start waited 0.2 s for it in vain)."""
    jobs = PatchJobs(running=1, wait_s=0.2, abandoned_s=30.0)
    jobs._slots = _LateRelease(jobs._slots)  # type: ignore[assignment]
    first = jobs.start_map(lambda: (1, iter([("resid", 0, [1.0])])))
    wait_for(lambda: jobs.get(first.id).state == "done", "the first map")
    second = jobs.start_map(lambda: (1, iter([("resid", 0, [2.0])])))  # no 429: the slot is free
    wait_for(lambda: jobs.get(second.id).state == "done", "the second map")


BAD = [
    ("an empty lens prompt", "lens", {"run": "runs/lm", "text": ""}, 400, "the text is empty"),
    ("a prompt longer than the context", "lens", {"run": "runs/lm", "text": "x" * 40}, 400, "reads at most 32"),
    ("a prompt longer than the lens grid", "lens", {"run": "runs/slow", "text": "x" * 100}, 400,
     "the lens of this model reads at most 64"),
    ("the lens of a translation run", "lens", {"run": "runs/tr", "text": "Hallo"}, 400, "reads two texts"),
    ("k = 0", "lens", {"run": "runs/lm", "text": "To", "k": 0}, 400, "'k' must be a whole number between 1 and 10"),
    ("path traversal", "lens", {"run": "../runs/lm", "text": "To"}, 403, "outside the directories"),
    ("an unknown run", "heads", {"run": "runs/nothing"}, 404, "no run named"),
    ("repeats longer than the context", "heads", {"run": "runs/lm", "length": 17}, 400, "between 2 and 16"),
    ("a string length", "heads", {"run": "runs/lm", "length": "9"}, 400, "'length' must be a whole number"),
    ("nine sequences", "heads", {"run": "runs/lm", "batch": 9}, 400, "'batch' must be a whole number between 1 and 8"),
    ("a negative seed", "heads", {"run": "runs/lm", "seed": -1}, 400, "'seed' must be a whole number"),
    ("prompts of different token lengths", "patching", {"run": "runs/lm", "clean": "To be", "corrupted": "To bee"},
     400, "the clean prompt is 5 tokens and the corrupted one 6"),
    ("an answer of two tokens", "patching", {"run": "runs/lm", "clean": "To be", "corrupted": "To bo", "answer": "ab"},
     400, "the answer 'ab' is 2 tokens ('a', 'b'); give exactly one token"),
    ("a wrong token outside the vocabulary", "patching", {"run": "runs/lm", "clean": "To", "corrupted": "Tu",
                                                          "wrong": "€"}, 400, "not in the vocabulary"),
    ("an answer that is a number", "patching", {"run": "runs/lm", "clean": "To", "corrupted": "Tu", "answer": 3},
     400, "'answer' must be a string"),
    ("the same answer and wrong token", "patching",
     {"run": "runs/lm", "clean": "To", "corrupted": "Tu", "answer": "e", "wrong": "e"}, 400, "are both 'e'"),
    ("two prompts the model answers alike", "patching",
     {"run": "runs/lm", "clean": "To be", "corrupted": "To be", "answer": "e", "wrong": "t"}, 400,
     "the same logit difference"),
    ("a patching prompt longer than the context", "patching",
     {"run": "runs/lm", "clean": "x" * 40, "corrupted": "y" * 40}, 400, "reads at most 32"),
    ("a patching prompt of 33 tokens", "patching", {"run": "runs/slow", "clean": "x" * 33, "corrupted": "y" * 33},
     400, "patching of this model reads at most 32"),
    ("an empty corrupted prompt", "patching", {"run": "runs/lm", "clean": "To", "corrupted": ""}, 400,
     "the corrupted prompt is empty"),
    ("patching a masked LM", "patching", {"run": "runs/mlm", "clean": "To", "corrupted": "Tu"}, 400,
     "open a language-model run"),
    ("an unknown map", "patching_status", {"job": "0123abcd"}, 404, "no patching map '0123abcd'"),
    ("no map named", "patching_cancel", {}, 400, "needs the field 'job'"),
]  # fmt: skip


@pytest.mark.parametrize("what, route, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_a_one_line_4xx(server: Any, what: str, route: str, body: dict[str, Any], status: int,
                                         message: str) -> None:  # fmt: skip
    got, answer = _request(server.url + "api/" + route, body)
    assert (got, type(answer)) == (status, dict), answer
    assert message in answer["error"] and "\n" not in answer["error"] and "Traceback" not in answer["error"]


def test_the_page_refuses_other_scripts(server: Any) -> None:
    import urllib.request

    with urllib.request.urlopen(server.url, timeout=30) as page:
        policy = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    for name in ("inside.js", "patch.js"):
        with urllib.request.urlopen(server.url + "static/" + name, timeout=30) as f:
            source = f.read().decode()
        assert "http://" not in source and "https://" not in source, name


# -------------------------------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def page(root: Path) -> Iterator[Page]:
    """The panel in Chromium, opened at #inside on runs/lm."""
    with opened_page(root, "runs/lm", "--runs", "runs", anchor="inside", height=2400) as page:
        yield page


def _shot(page: Page, element_id: str, name: str) -> None:
    """Keep a screenshot of one view when QKV_EXPLORE_SHOTS names a directory."""
    folder = os.environ.get("QKV_EXPLORE_SHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.driver.find_element("id", element_id).screenshot(str(Path(folder) / f"{name}.png"))


def _open(page: Page, run: str) -> None:
    page.set_value("inside-run", run, event="change")
    wait_for(lambda: page.js("return document.getElementById('inside-info').dataset.run") == run, f"{run} to open")


def _cells(page: Page, selector: str, *attributes: str) -> list[list[str]]:
    return list(page.js("return Array.from(document.querySelectorAll(arguments[0])).map(e => arguments[1].map("
                        "a => e.getAttribute(a)));", selector, list(attributes)))  # fmt: skip


def test_page_lens_grid_is_the_logit_lens(page: Page) -> None:
    page.tab("inside")
    _open(page, "runs/lm")
    page.set_value("lens-text", LENS_TEXT)
    run = load(page.root / "runs" / "lm")
    lens = logit_lens(run.model, _ids(run, LENS_TEXT))
    probs, top = lens.top(5)
    n = len(lens.labels) * len(LENS_TEXT)
    attributes = ("data-row", "data-col", "data-top-ids", "data-top-probs", "title")
    cells = wait_for(lambda: (c := _cells(page, "#lens-grid td", *attributes)) and len(c) == n and c, "the lens grid")
    for row, col, ids, shown, title in cells:
        r, c = int(row), int(col)
        assert [int(i) for i in ids.split(",")] == top[r, 0, c].tolist()
        np.testing.assert_allclose([float(p) for p in shown.split(",")], probs[r, 0, c].numpy(), atol=1e-5, rtol=0)
        assert len(title.splitlines()) == 6  # where, then the top 5
    assert page.texts("#lens-note")[0] == lens.note
    _shot(page, "lens-view", "lens")
    _open(page, "runs/post")
    wait_for(lambda: "no final norm" in page.texts("#lens-note")[0], "the note of a model without a final norm")
    assert page.js("return document.getElementById('lens-note').classList.contains('warn')")
    _open(page, "runs/lm")


def test_page_patching_fills_with_progress(page: Page) -> None:
    page.tab("inside")
    _open(page, "runs/slow")
    for element_id, value in (("patch-clean", CLEAN), ("patch-corrupted", CORRUPTED), ("patch-answer", "b"),
                              ("patch-wrong", "t")):  # fmt: skip
        page.set_value(element_id, value)
    page.driver.find_element("id", "patch-run").click()
    wait_for(lambda: "16 of 16" in page.texts("#patch-info")[0], "the patching map", timeout=120)
    history = page.js("return document.getElementById('patch-progress').qkvHistory")
    assert history[0][0] == 0 and history[-1][:2] == [16, 16]
    assert any(0 < done < 16 for done, *_ in history), history  # drawn part by part
    run = load(page.root / "runs" / "slow")
    tokenizer = run.require_tokenizer()
    expected = activation_patching(run.model, _ids(run, CLEAN), _ids(run, CORRUPTED), tokenizer.encode("b")[0],
                                   tokenizer.encode("t")[0])  # fmt: skip
    assert expected.heads is not None
    for table, values in (("patch-resid", expected.resid), ("patch-heads-map", expected.heads)):
        shown = [float(v) for (v,) in _cells(page, f"#{table} td", "data-value")]
        np.testing.assert_allclose(np.reshape(shown, values.shape), values.numpy(), atol=1e-5, rtol=0)
    metric = page.js("return Object.assign({}, document.getElementById('patch-metric').dataset)")
    assert float(metric["clean"]) == pytest.approx(expected.clean, abs=1e-5)
    assert float(metric["corrupted"]) == pytest.approx(expected.corrupted, abs=1e-5)
    _shot(page, "patch-view", "patching")
    page.set_value("patch-clean", "To be")  # 5 tokens against 32: refused, and the page says why
    page.driver.find_element("id", "patch-run").click()
    wait_for(lambda: "same token length" in page.texts("#status")[0], "the refusal in the status line")
    _open(page, "runs/lm")


def test_page_head_scores_are_qkv_interpret_head_scores(page: Page) -> None:
    page.tab("inside")
    _open(page, "runs/lm")
    run = load(page.root / "runs" / "lm")
    tokenizer = run.require_tokenizer()
    low, high = ordinary_range(tokenizer, tokenizer.vocab_size)
    ids = repeated_tokens(4, 16, high, torch.Generator().manual_seed(0), low)
    induction, previous = head_scores(run.model, ids)
    for table, values in (("heads-induction", induction), ("heads-previous", previous)):
        shown = wait_for(lambda t=table: [float(v) for (v,) in _cells(page, f"#{t} td", "data-value")], table)
        np.testing.assert_allclose(np.reshape(shown, values.shape), values.numpy(), atol=1e-5, rtol=0)
    top = _cells(page, "#heads-top li", "data-layer", "data-head", "data-value")
    assert [int(a) * 2 + int(b) for a, b, _ in top] == induction.flatten().topk(4).indices.tolist()
    np.testing.assert_allclose([float(v) for *_, v in top], induction.flatten().topk(4).values, atol=1e-5)
    _shot(page, "heads-view", "heads")


def test_the_panel_logs_no_error_and_asks_only_its_server(page: Page) -> None:
    page.tab("inside")
    page.assert_clean("patching", "lens")  # the test asked for that refusal
