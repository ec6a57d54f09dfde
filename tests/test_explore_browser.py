"""`qkv explore`'s page in a real headless Chromium: what a person sees is what qkv computes.

One server (a real `qkv explore` process) and one browser serve every test here. The browser records its
console and every request the page makes; the last two tests fail on any console error and on any request
to another host than the local server.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
from helpers import chrome, explore_server, find_browser, requested_urls, subprocess_env

from qkv.attention import record_attention
from qkv.lab.walkthrough import builtin_example, walkthrough
from qkv.tasks import load
from qkv.translation.attention_maps import recorded_translation

LM_TEXT = "To be, or not"
GERMAN = "Wie geht es dir?"


@dataclass
class Page:
    """The browser on the explorer, and everything it logged and requested so far."""

    driver: Any
    url: str
    root: Path
    console: list[dict[str, Any]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def collect(self) -> None:
        """Move the browser's new console entries and requests into this record."""
        self.console += self.driver.get_log("browser")
        self.requests += requested_urls(self.driver)

    def tab(self, name: str) -> None:
        """Show one panel."""
        self.driver.find_element("css selector", f'#tabs button[data-tab="{name}"]').click()

    def js(self, script: str, *args: Any) -> Any:
        """Run JavaScript in the page."""
        return self.driver.execute_script(script, *args)

    def set_value(self, element_id: str, value: Any, event: str = "input") -> None:
        """Set a control's value as a person moving it would, with the event that follows."""
        self.js(f"const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                f"e.dispatchEvent(new Event('{event}', {{bubbles: true}}));", element_id, str(value))  # fmt: skip

    def assert_clean(self, refused_route: str, asked_route: str) -> None:
        """No console error or warning but the 400 of `refused_route` that a test asked for, and every request to
        the local server only, `asked_route` among them."""
        self.collect()
        refused = f"api/{refused_route} - Failed to load resource: the server responded with a status of 400"
        errors = [e for e in self.console if e["level"] in ("SEVERE", "WARNING") and refused not in e["message"]]
        assert errors == [], errors
        hosts = {urlsplit(u).netloc for u in self.requests if not u.startswith(("data:", "blob:", "about:"))}
        assert hosts == {urlsplit(self.url).netloc} and any(f"/api/{asked_route}" in u for u in self.requests)

    def texts(self, selector: str) -> list[str]:
        """The text of every element matching a CSS selector."""
        return list(self.js("return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent);",
                            selector))  # fmt: skip


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll until check() returns something truthy; fail naming `what` after the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception:  # the page is still being drawn (a stale element, a missing node)
            value = None
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@contextlib.contextmanager
def opened_page(root: Path, *args: str, anchor: str = "", height: int = 1600) -> Iterator[Page]:
    """Headless Chromium on a real `qkv explore ARGS` run in root, at #anchor, once the page says it is ready."""
    browser = find_browser()  # before the work: a missing browser fails at once, with the reason
    with explore_server(root, *args) as explorer:
        driver = chrome(*browser, height=height)
        try:
            driver.get(explorer.url + (f"#{anchor}" if anchor else ""))
            page = Page(driver, explorer.url, root)
            wait_for(lambda: page.js("return window.qkvExplore && window.qkvExplore.ready"), "the page to load")
            yield page
        finally:
            driver.quit()


@pytest.fixture(scope="module")
def page(explore_root: Path) -> Iterator[Page]:
    """The runs of conftest.explore_root (a 2-layer × 2-head language model, a translation model) in Chromium."""
    with opened_page(explore_root, "runs/lm") as page:
        yield page


@pytest.fixture(autouse=True)
def _record(page: Page) -> Iterator[None]:
    """After each test, keep what the browser logged and requested."""
    yield
    page.collect()


def _weights(page: Page) -> list[float]:
    return [float(v) for v in page.texts("#sheet-weights td:not(.result)")]


def test_editing_a_cell_gives_the_lab_walkthrough_weights(page: Page) -> None:
    page.tab("sheet")
    words, emb = builtin_example("classic")
    before = wait_for(lambda: _weights(page) if len(_weights(page)) == 8 else None, "the spreadsheet")
    np.testing.assert_allclose(before, walkthrough(words, emb, "bank").weights, atol=1e-4)
    cell = page.driver.find_element("css selector", 'input.cell[data-word="7"][data-dim="1"]')  # bank's x2
    cell.clear()
    cell.send_keys("0.9")
    emb[7, 1] = 0.9
    expected = walkthrough(words, emb, "bank").weights
    # Each key typed updates the page; wait for the answer to the whole number, then compare.
    got = wait_for(
        lambda: (w := _weights(page)) and np.allclose(w, expected, rtol=0, atol=1e-4) and w,
        f"the weights of the edited table, {expected.round(4).tolist()} (showing {_weights(page)})",
    )
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert expected.max() > 0.2  # the edit moved "bank" towards itself: a real change, not rounding


def test_scale_slider_at_100_saturates_the_softmax(page: Page) -> None:
    page.tab("sheet")
    page.set_value("sheet-scale", 100)
    largest = wait_for(lambda: (p := float(page.texts("#sheet-maxprob")[0])) > 0.999 and p, "saturation")
    assert largest > 0.999
    assert float(page.texts("#sheet-jacobian")[0]) < 0.05
    page.set_value("sheet-scale", 1)


def test_causal_switch_zeroes_the_upper_triangle(page: Page) -> None:
    page.tab("weights")
    cells = "#tw-weights td"

    def upper() -> list[float]:
        values = [
            float(v)
            for v in page.js(
                "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.dataset.value);", cells
            )
        ]
        return [values[5 * i + j] for i in range(5) for j in range(i + 1, 5)]

    assert all(v > 0 for v in wait_for(upper, "the trainable weights"))
    page.driver.find_element("id", "tw-causal").click()
    zeros = wait_for(lambda: (u := upper()) and all(v == 0 for v in u) and u, "the causal mask")
    assert len(zeros) == 10
    assert page.texts("#tw-scaled td")[1] == "−∞"  # what the softmax saw above the diagonal
    page.driver.find_element("id", "tw-causal").click()


def _type(page: Page, text: str) -> None:
    box = page.driver.find_element("id", "model-text")
    box.clear()
    box.send_keys(text)


def _maps(page: Page, kind: str) -> dict[tuple[int, int], np.ndarray]:
    """The numbers behind every drawn heat map of one kind, by (layer, head)."""
    found = page.js("return Array.from(document.querySelectorAll('#model-grid canvas')).map(c => "
                    "[c.dataset.kind, Number(c.dataset.layer), Number(c.dataset.head), c.qkvWeights]);")  # fmt: skip
    return {(layer, head): np.array(w) for k, layer, head, w in found if k == kind}


def test_typed_text_draws_every_layer_and_head_with_the_models_weights(page: Page) -> None:
    page.tab("model")
    _type(page, LM_TEXT)
    run = load(page.root / "runs" / "lm")
    ids = run.require_tokenizer().encode(LM_TEXT)
    with torch.no_grad(), record_attention(run.model) as recorder:
        run.model(torch.tensor([ids]))
    expected = recorder.weights_of("decoder.layers.*.self_attn")  # (1, heads, T, T) per layer
    maps = wait_for(lambda: (m := _maps(page, "self")) and next(iter(m.values())).shape[0] == len(ids) and m,
                    "the heat maps of the typed text")  # fmt: skip
    assert sorted(maps) == [(layer, head) for layer in range(2) for head in range(2)]
    for (layer, head), weights in maps.items():
        np.testing.assert_allclose(weights, expected[layer][0, head].numpy(), atol=1e-5)
    assert page.js("return document.getElementById('model-heatmap').qkvWeights.length") == len(ids)


def test_temperature_zero_steps_give_the_greedy_tokens_of_qkv_generate(page: Page) -> None:
    page.tab("model")
    _type(page, "ROMEO:")
    wait_for(lambda: _maps(page, "self") and next(iter(_maps(page, "self").values())).shape[0] == 6, "the maps")
    page.set_value("gen-temperature", 0)
    page.driver.find_element("id", "gen-reset").click()
    n = 8
    for i in range(n):
        page.driver.find_element("id", "gen-step").click()
        wait_for(lambda i=i: len(page.texts("#gen-output .generated")) == i + 1, f"generated token {i + 1}")
    shown = "".join(page.texts("#gen-output .generated"))
    done = subprocess.run([sys.executable, "-m", "qkv", "generate", "runs/lm", "--prompt", "ROMEO:", "--temperature",
                           "0", "--max-new-tokens", str(n)], cwd=page.root, capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == "ROMEO:" + shown
    assert len(page.js("return document.querySelectorAll('#gen-row canvas')")) == 2  # one attention row per layer
    page.set_value("gen-temperature", 1)


def test_a_translation_run_shows_cross_attention(page: Page) -> None:
    page.tab("model")
    page.set_value("model-run", "runs/tr", event="change")
    wait_for(lambda: "cross" in page.texts("#model-kind option")[0], "the translation run to open")
    _type(page, GERMAN)
    run = load(page.root / "runs" / "tr")
    src, tgt, recorder = recorded_translation(run.translator(), GERMAN)
    expected = recorder.weights_of("decoder.layers.*.cross_attn")  # (1, heads, T_out, T_src) per layer
    maps = wait_for(lambda: (m := _maps(page, "cross")) and next(iter(m.values())).shape == (len(tgt), len(src)) and m,
                    "the cross-attention maps")  # fmt: skip
    assert len(maps) == len(expected) * expected[0].shape[1]
    for (layer, head), weights in maps.items():
        np.testing.assert_allclose(weights, expected[layer][0, head].numpy(), atol=1e-5)
    translation = run.translator().translate([GERMAN], beam_size=1)[0]
    assert page.texts("#model-translation")[0] == f"→ “{translation}”"
    page.set_value("model-run", "runs/lm", event="change")


def test_every_panel_draws_without_a_console_error(page: Page) -> None:
    for tab in ("positions", "weights", "model", "inside", "sheet"):
        page.tab(tab)
        time.sleep(0.3)
    wait_for(lambda: page.js("return document.querySelectorAll('#heads-top li').length"), "the inside panel")
    page.collect()
    assert page.js("return document.querySelectorAll('#norm-outputs table').length") == 4
    assert page.js("return document.querySelectorAll('#lens-grid td').length") == 3 * len("The capital of France is")
    errors = [entry for entry in page.console if entry["level"] in ("SEVERE", "WARNING")]
    assert errors == [], errors
    assert page.texts("#status")[0] == ""


def test_every_request_goes_to_the_local_server(page: Page) -> None:
    page.collect()
    served = urlsplit(page.url).netloc
    hosts = {urlsplit(u).netloc for u in page.requests if not u.startswith(("data:", "blob:", "about:"))}
    assert len(page.requests) > 20  # the record is real: the page, its scripts and the API calls
    assert hosts == {served}, hosts
