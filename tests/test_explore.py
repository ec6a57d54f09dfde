"""Tests for `qkv explore`'s server and numbers (the page itself: test_explore_browser.py).

The panels' numbers against qkv.lab and the models, the run library's roots (no path traversal), and
the real server as a process: loopback only, Host-header check, a 4xx JSON error for every bad request
and never a 500, and Ctrl-C that stops it cleanly.
"""

from __future__ import annotations

import base64
import json
import math
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import explore_server

from qkv.attention import record_attention
from qkv.errors import QkvError
from qkv.explore import model_panel, panels
from qkv.explore.library import RequestError, RunLibrary
from qkv.explore.server import HostCheck, allowed_hosts
from qkv.generation import Sampling
from qkv.io.sockets import parse_host
from qkv.lab.walkthrough import CLASSIC, builtin_example, walkthrough
from qkv.tasks import load


@pytest.fixture(scope="module")
def root(explore_root: Path) -> Path:
    """The working directory of the runs (conftest.explore_root)."""
    return explore_root


@pytest.fixture(scope="module")
def server(root: Path) -> Any:
    """The explorer serving root/runs, as a real process."""
    with explore_server(root, "--runs", "runs") as explorer:
        yield explorer


def _unpack(packed: dict[str, Any]) -> np.ndarray:
    """A matrix the API packed: base64 float32 with its shape."""
    return np.frombuffer(base64.b64decode(packed["data"]), dtype="<f4").reshape(packed["shape"])


def _request(url: str, body: Any = None, raw: bytes | None = None, host: str | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    """(status, parsed JSON answer) of a GET (body None) or POST to the server."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    if host is not None:
        request.add_header("Host", host)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# ------------------------------------------------------------------------------------------ the panels


def test_spreadsheet_is_the_lab_walkthrough_with_saturation_measures() -> None:
    words, emb = builtin_example("classic")
    answer = panels.spreadsheet(words, emb.tolist(), 7)
    reference = walkthrough(words, emb, "bank")
    assert answer["scale"] == pytest.approx(1 / math.sqrt(3))
    np.testing.assert_allclose(answer["weights"], reference.weights, atol=1e-12)
    np.testing.assert_allclose(answer["context"], reference.context, atol=1e-9)
    y = reference.weights
    assert answer["entropy"] == pytest.approx(-(y * np.log(y)).sum())
    assert answer["jacobian_norm"] == pytest.approx(np.linalg.norm(np.diag(y) - np.outer(y, y)))
    saturated = panels.spreadsheet(words, emb.tolist(), 7, factor=100.0)
    assert saturated["max_prob"] > 0.999 and saturated["jacobian_norm"] < 0.05
    unscaled = panels.spreadsheet(words, emb.tolist(), 7, sqrt_scale=False, factor=2.0)
    assert unscaled["scale"] == 2.0


def test_the_classic_table_is_the_one_the_lab_offers() -> None:
    table = panels.classic_table()
    assert table["words"] == ["A", "Man", "has", "kept", "money", "in", "the", "bank"]
    assert table["embeddings"][7] == [0.02, -0.286, 0.524]
    assert table["embeddings"] == [list(v) for v in CLASSIC.values()]


def test_trainable_causal_mask_zeroes_the_upper_triangle() -> None:
    plain, causal = panels.trainable(123, False), panels.trainable(123, True)
    weights = np.array(causal["weights"])
    assert weights.shape == (5, 5) and np.all(np.triu(weights, 1) == 0)
    np.testing.assert_allclose(weights.sum(1), 1.0, atol=1e-12)
    assert np.all(np.array(plain["weights"])[np.triu_indices(5, 1)] > 0)
    assert causal["scaled"][0][1] is None and causal["scaled"][1][0] is not None  # −inf travels as null
    np.testing.assert_allclose(np.array(plain["scores"]), np.array(plain["q"]) @ np.array(plain["k"]).T, atol=1e-9)


def test_multi_head_shapes_are_written_out() -> None:
    answer = panels.multi_head(8, 0)
    shapes = {s["name"]: tuple(s["shape"]) for s in answer["steps"]}
    assert shapes["X"] == (6, 512) and shapes["Q per head"] == (8, 6, 64)
    assert shapes["concatenated"] == (6, 512) and shapes["output"] == (6, 512)
    assert np.array(answer["weights"]).shape == (8, 6, 6) and answer["max_abs_diff"] < 1e-5
    with pytest.raises(QkvError, match="n_heads must be one of"):
        panels.multi_head(3, 0)


def test_positions_shift_is_a_rotation_and_norms_normalise_their_axis() -> None:
    pe = panels.positions(64, 10, 5)
    assert pe["rotation_error"] < 1e-5 and np.array(pe["table"]).shape == (100, 64)
    np.testing.assert_allclose(pe["rotated"], pe["pe_p_k"], atol=1e-5)
    with pytest.raises(QkvError):
        panels.positions(64, 99, 5)
    out = panels.norms([[1, 2, 3, 10], [2, 4, 6, 20], [0.5, -1, 3, 5]])
    np.testing.assert_allclose(out["batch"]["feature_mean"], 0, atol=1e-6)
    np.testing.assert_allclose(out["batch"]["feature_std"], 1, atol=1e-4)
    np.testing.assert_allclose(out["layer"]["token_mean"], 0, atol=1e-6)
    np.testing.assert_allclose(out["layer"]["token_std"], 1, atol=1e-4)
    np.testing.assert_allclose(out["rms"]["token_rms"], 1, atol=1e-4)


def test_model_panel_numbers_are_the_models(root: Path) -> None:
    run = load(root / "runs" / "lm")
    text = "To be, or not"
    answer = model_panel.attention(run, text)
    got = _unpack(answer["kinds"]["self"]["weights"])
    ids = run.require_tokenizer().encode(text)
    with torch.no_grad(), record_attention(run.model) as recorder:
        logits = run.model(torch.tensor([ids]))[0, -1]
    expected = torch.cat(recorder.weights_of("decoder.layers.*.self_attn")).numpy()  # (layers, heads, T, T)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    greedy = model_panel.step(run, text, None, Sampling(temperature=0.0))
    assert greedy["token"] == int(logits.argmax()) and greedy["ids"][:-1] == ids
    np.testing.assert_allclose(_unpack(greedy["rows"]), expected[:, :, -1], atol=1e-6)
    shaped = model_panel.next_token(run, text, None, Sampling(temperature=1.0, top_k=3))
    assert shaped["kept"] == 3 and sum(p > 0 for p in shaped["probs"]) == 3
    assert sum(shaped["probs"]) == pytest.approx(1.0, abs=1e-5)


def test_generation_steps_read_only_the_new_token(root: Path) -> None:
    """Each step goes through the engine, whose slot keeps the window read before: the next step reads one token,
    and its attention rows and token are the full forward pass's."""
    run = load(root / "runs" / "lm")
    read: list[int] = []
    hook = run.model.embed.register_forward_hook(lambda _m, args, _o: read.append(args[0].shape[1]))
    try:
        ids = model_panel.step(run, "To be, or not", None, Sampling(temperature=0.0))["ids"]
        for _ in range(3):
            read.clear()
            answer = model_panel.step(run, None, ids, Sampling(temperature=0.0))
            assert read == [1]
            with torch.no_grad(), record_attention(run.model) as recorder:
                logits = run.model(torch.tensor([ids]))[0, -1]
            rows = torch.cat(recorder.weights_of("decoder.layers.*.self_attn"))[:, :, -1].numpy()
            np.testing.assert_allclose(_unpack(answer["rows"]), rows, atol=1e-6)
            assert answer["token"] == int(logits.argmax()) and answer["ids"][:-1] == ids
            ids = answer["ids"]
    finally:
        hook.remove()


# ------------------------------------------------------------------------------------------- the library


def test_run_library_serves_nothing_outside_its_roots(root: Path, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(root)
    library = RunLibrary(None, Path("runs"))
    assert [(r.name, r.task) for r in library.available()] == [("runs/lm", "lm"), ("runs/mlm", "mlm"),
                                                               ("runs/tr", "translate")]  # fmt: skip
    assert library.resolve("runs/lm").task == "lm"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text('{"task": "lm"}')
    (root / "runs" / "link").symlink_to(outside)  # a link inside runs/ that leads out of it
    try:
        for name in ("../data", "runs/../data", str(outside), "runs/link", "/etc"):
            with pytest.raises(RequestError) as refused:
                library.resolve(name)
            assert refused.value.status == 403, name
    finally:
        (root / "runs" / "link").unlink()
    with pytest.raises(RequestError) as unknown:
        library.resolve("runs/nothing")
    assert unknown.value.status == 404
    assert allowed_hosts("127.0.0.1", 8000) == {"127.0.0.1:8000", "localhost:8000", "[::1]:8000"}


def test_host_check_on_every_interface_takes_ip_addresses_only() -> None:
    """--host 0.0.0.0: any address of this machine may be in the Host header, a domain name (rebinding) may not."""
    check = HostCheck(lambda *a: None, "0.0.0.0", 8000)  # type: ignore[arg-type]
    assert check.host_ok("192.168.1.20:8000") and check.host_ok("127.0.0.1:8000") and check.host_ok("[::1]:8000")
    assert check.host_ok("localhost:8000")
    assert not check.host_ok("attacker.example:8000") and not check.host_ok("192.168.1.20:9999")
    loopback = HostCheck(lambda *a: None, "127.0.0.1", 8000)  # type: ignore[arg-type]
    assert not loopback.host_ok("192.168.1.20:8000")
    assert parse_host("localhost") == "127.0.0.1" and parse_host("[::1]") == "::1"
    with pytest.raises(QkvError, match="--host must be an IP address"):
        parse_host("example.com")


# -------------------------------------------------------------------------------------------- the server


def test_server_listens_on_loopback_and_checks_the_host_header(server: Any) -> None:
    assert server.url.startswith("http://127.0.0.1:")
    port = server.url.rstrip("/").rsplit(":", 1)[1]
    assert _request(server.url + "api/runs")[0] == 200
    assert _request(server.url + "api/runs", host=f"localhost:{port}")[0] == 200
    for host in ("evil.example:" + port, "127.0.0.1:1", "attacker.test"):
        status, answer = _request(server.url + "api/runs", host=host)
        assert status == 403 and "not the address this explorer serves" in answer["error"], host


BAD_REQUESTS = [
    ("an unknown run", "attention", {"run": "runs/nothing", "text": "To be"}, 404, "no run named"),
    ("text longer than the context", "attention", {"run": "runs/lm", "text": "x" * 40}, 400, "reads at most 32"),
    ("malformed JSON", "attention", b'{"run": "runs/lm", "text": ', 400, "malformed JSON"),
    ("a layer out of range", "attention", {"run": "runs/lm", "text": "To", "layer": 2}, 400,
     "'layer' must be a whole number between 0 and 1, got 2"),
    ("a head out of range", "attention", {"run": "runs/lm", "text": "To", "head": -1}, 400,
     "'head' must be a whole number between 0 and 1, got -1"),
    ("path traversal", "attention", {"run": "../data", "text": "To"}, 403, "outside the directories"),
    ("an absolute path outside", "model", {"run": "/etc"}, 403, "outside the directories"),
    ("a JSON array", "spreadsheet", b"[1, 2]", 400, "must be a JSON object"),
    ("a missing field", "spreadsheet", {"words": ["a"]}, 400, "needs the field 'embeddings'"),
    (
        "ragged embeddings",
        "spreadsheet",
        {"words": ["a", "b"], "embeddings": [[1, 2], [3]], "query": 0},
        400,
        "same length",
    ),
    (
        "one vector for two words",
        "spreadsheet",
        {"words": ["a", "b"], "embeddings": [[1, 2]], "query": 0},
        400,
        "one embedding row per word",
    ),
    ("a query out of range", "spreadsheet", {"words": ["a"], "embeddings": [[1]], "query": 3}, 400, "'query'"),
    ("a string for a number", "positions", {"d_model": "64"}, 400, "'d_model' must be a whole number"),
    ("an odd d_model", "positions", {"d_model": 63}, 400, "even"),
    ("a negative temperature", "next", {"run": "runs/lm", "text": "To", "temperature": -1}, 400, "'temperature'"),
    ("next token of a translation run", "next", {"run": "runs/tr", "text": "Hallo"}, 400, "does not predict"),
    ("an empty text", "attention", {"run": "runs/lm", "text": ""}, 400, "empty"),
    ("ids outside the vocabulary", "step", {"run": "runs/lm", "ids": [10**6]}, 400, "token ids must be between"),
    ("a 1-feature batch", "norms", {"batch": [[1], [2]]}, 400, "2 to 16 features"),
    ("an unknown route", "nothing", {}, 404, "no API route"),
    (
        "a 400-digit number",
        "spreadsheet",
        b'{"words": ["a"], "embeddings": [[1]], "query": 0, "factor": 1' + b"0" * 400 + b"}",
        400,
        "'factor' must be a finite number",
    ),
    ("arrays nested 100,000 deep", "spreadsheet", b"[" * 100_000, 400, "malformed JSON"),
    ("a cell of 1e200", "spreadsheet", {"words": ["a"], "embeddings": [[1e200]], "query": 0}, 400, "numbers between"),
    (
        "a factor that underflows every exponential",
        "spreadsheet",
        {"words": ["a", "b"], "embeddings": [[1000, 0], [0, 1000]], "query": 0, "factor": -1e6},
        200,
        "",
    ),
    (
        "a temperature of 1e-40",
        "next",
        {"run": "runs/lm", "text": "To", "temperature": 1e-40},
        400,
        "0 (greedy) or at least 0.001",
    ),
    ("a NUL in a run name", "model", {"run": "runs/lm\x00"}, 400, "NUL"),
    ("a body over 1 MiB", "norms", b'{"batch": "' + b"x" * (1 << 20) + b'"}', 413, "larger than"),
]


@pytest.mark.parametrize("what, route, body, status, message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_a_4xx_json_error(server: Any, what: str, route: str, body: Any, status: int,
                                           message: str) -> None:  # fmt: skip
    raw = body if isinstance(body, bytes) else None
    got, answer = _request(server.url + "api/" + route, None if raw else body, raw)
    assert (got, type(answer)) == (status, dict), answer
    if status == 200:  # not refused: the numbers were shifted before exponentiating, as they should be
        assert answer["weights"] == [1.0, 0.0] or sum(answer["weights"]) == pytest.approx(1.0)
        return
    assert message in answer["error"] and "\n" not in answer["error"] and "Traceback" not in answer["error"]


def test_requests_from_other_pages_are_refused(server: Any) -> None:
    """Another site's page can make the browser post here (no preflight for text/plain): it is refused."""
    body = {"words": ["a"], "embeddings": [[1]], "query": 0}
    status, answer = _request(server.url + "api/spreadsheet", body, headers={"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in answer["error"]
    status, answer = _request(server.url + "api/spreadsheet", body, headers={"Origin": "http://evil.example"})
    assert status == 403 and "only the explorer's own page" in answer["error"]
    own = server.url.rstrip("/")
    assert _request(server.url + "api/spreadsheet", body, headers={"Origin": own})[0] == 200


def test_get_on_a_post_route_and_the_page_itself(server: Any) -> None:
    assert _request(server.url + "api/spreadsheet")[0] == 405
    with urllib.request.urlopen(server.url, timeout=30) as page:
        html = page.read().decode()
    assert "/static/app.js" in html and "http://" not in html and "https://" not in html  # nothing from elsewhere
    for name in ("app.js", "common.js", "sheet.js", "weights.js", "model.js", "positions.js", "style.css"):
        with urllib.request.urlopen(server.url + "static/" + name, timeout=30) as f:
            assert "https://" not in f.read().decode(), name


def test_ctrl_c_stops_the_server_cleanly(root: Path) -> None:
    with explore_server(root, "runs/lm") as explorer:
        assert _request(explorer.url + "api/runs")[1]["default"] == "runs/lm"
        code, out, err = explorer.stop()
    assert code == 0, err
    assert out.strip().endswith("qkv explore: stopped") and "Traceback" not in err


def test_explore_refuses_bad_arguments_in_one_line(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helpers import run_main

    refusals = [(["explore", "nowhere"], "nowhere: no such file or directory"),
                (["explore", "--port", "70000"], "--port must be between 0 and 65535"),
                (["explore", "--host", "example.com", "--no-browser"], "--host must be an IP address")]  # fmt: skip
    for argv, message in refusals:
        code, _, err = run_main(capsys, *argv)
        assert code == 2 and err.strip().splitlines()[-1].startswith("qkv explore: error: ") and message in err, err


def test_masked_lm_and_translation_runs_show_their_kinds_of_attention(root: Path) -> None:
    """An MLM run: one bidirectional self-attention, no next token; a translation run: encoder, decoder, cross."""
    mlm = load(root / "runs" / "mlm")
    answer = model_panel.attention(mlm, "To be, or not to be")
    got = _unpack(answer["kinds"]["self"]["weights"])
    assert list(answer["kinds"]) == ["self"] and not model_panel.describe(mlm)["causal"]
    assert np.triu(got, 1).max() > 0  # every token sees the ones after it too
    with pytest.raises(QkvError, match="does not predict the next token"):
        model_panel.next_token(mlm, "To be", None, Sampling())
    tr = load(root / "runs" / "tr")
    answer = model_panel.attention(tr, "Guten Morgen")
    assert list(answer["kinds"]) == ["encoder", "decoder", "cross"]
    assert answer["translation"] == tr.translator().translate(["Guten Morgen"], beam_size=1)[0]
    cross = answer["kinds"]["cross"]
    assert cross["key_tokens"] != cross["query_tokens"] and cross["weights"]["shape"][-1] == len(cross["key_tokens"])
