"""Training from shards: the speed of `qkv train` against the in-memory data path it replaced, its memory and its
start-up against the size of the corpus.

speed: the default `qkv train` on the embedded Shakespeare, with the code of this checkout and with the code of
       --baseline-rev (the commit before `qkv prepare`, whose LM task held the corpus as int64 tensors), in
       alternate runs in fresh processes (A B, B A, …); tokens/s is the loop's own step timing (on_step:
       drawing the batch, forward, backward, optimiser) of the median step, the first 20 steps left out; the
       median of each side's runs.
memory, start-up: `qkv train --data DIR` on two prepared data directories (a small and a large corpus, the same
       settings); the peak RssAnon of the process (anonymous memory: the memory-mapped shards' pages are file
       pages and are not counted) sampled every 20 ms, and the seconds from launching the process to the end of
       its first optimiser step.

    python benchmarks/train_data.py speed --baseline-rev ec6d511 --runs 5
    python benchmarks/train_data.py memory --small /tmp/p10 --large /tmp/p1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qkv.bench import PeakMemory, save_report

ROOT = Path(__file__).resolve().parents[1]
# A run in a fresh process: settings as JSON in argv[1]; prints the launch-relative time of the first step and
# the tokens/s of the steps after the first 20 (tokens per step / the median step: a step slowed by a neighbour
# on the shared machine does not count), from the loop's on_step hook.
CHILD = """
import json, statistics, sys, time
from qkv.tasks import recipe, train
from qkv.training import Hooks
import qkv
settings = json.loads(sys.argv[1])
steps = []
def on_step(info):
    if info.step == 1:
        print("FIRST_STEP", time.time(), flush=True)
    steps.append((info.seconds, info.tokens))
train(recipe("lm", settings), verbose=False, hooks=Hooks(on_step=on_step))
timed = steps[20:]
print("QKV", qkv.__file__, flush=True)
print("TOKENS_PER_S", statistics.median(t / s for s, t in timed), flush=True)
"""


def run_child(settings: dict[str, Any], src: Path) -> dict[str, float]:
    """One training run in a fresh process with the qkv in `src`: first-step seconds, tokens/s, peak RssAnon."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1"}
    launched = time.time()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(settings)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    memory = PeakMemory(proc.pid, "RssAnon")
    out, err = proc.communicate()
    peak = memory.stop()
    if proc.returncode != 0:
        raise SystemExit(f"training failed:\n{err}")
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    if not lines["QKV"].startswith(str(src)):
        raise SystemExit(f"the run imported {lines['QKV']}, not the qkv in {src}")
    return {"first_step_s": float(lines["FIRST_STEP"]) - launched, "tokens_per_s": float(lines["TOKENS_PER_S"]),
            "peak_anon_bytes": peak}  # fmt: skip


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """This checkout against --baseline-rev on the default recipe, alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.baseline_rev],
                       check=True, capture_output=True)  # fmt: skip
        try:
            rows = []
            for run in range(args.runs):
                row = {}
                sides = [("baseline", old / "src"), ("shards", ROOT / "src")]
                for name, src in sides if run % 2 == 0 else sides[::-1]:  # ABBA: neither side always goes first
                    settings = {"device": "cpu", "sample_tokens": 0, "out_dir": str(Path(tmp) / f"{name}-{run}")}
                    row[name] = run_child(settings, src)["tokens_per_s"]
                rows.append(row)
                print(f"run {run + 1}: in-memory (rev {args.baseline_rev}) {row['baseline']:,.0f} tok/s, shards "
                      f"{row['shards']:,.0f} tok/s ({row['shards'] / row['baseline']:.3f}×)", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True)
    base = statistics.median(r["baseline"] for r in rows)
    shards = statistics.median(r["shards"] for r in rows)
    print(f"median: in-memory {base:,.0f} tok/s, shards {shards:,.0f} tok/s: {shards / base:.3f}×")
    return {"runs": rows, "median_ratio": shards / base}


def memory(args: argparse.Namespace) -> dict[str, Any]:
    """The same short run on a small and a large data directory: peak anonymous memory and time to the first step."""
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in (("small", args.small), ("large", args.large)):
            meta = json.loads((data / "meta.json").read_text())
            tokens = sum(s["tokens"] for s in meta["splits"].values())
            settings = {"data": str(data), "device": "cpu", "max_steps": args.steps, "eval_interval": args.steps // 2,
                        "final_eval_tokens": 100_000, "sample_tokens": 0, "out_dir": str(Path(tmp) / name)}  # fmt: skip
            row = run_child(settings, ROOT / "src")
            result[name] = {"tokens": tokens, **row}
            print(f"{name}: {tokens:,} tokens: first step {row['first_step_s']:.2f} s after launch, peak RssAnon "
                  f"{row['peak_anon_bytes'] / 2**20:,.0f} MiB, {row['tokens_per_s']:,.0f} tok/s", flush=True)
    diff = (result["large"]["peak_anon_bytes"] - result["small"]["peak_anon_bytes"]) / 2**20
    print(f"large − small peak RssAnon: {diff:+,.0f} MiB")
    result["anon_difference_mib"] = diff
    return result


def main() -> None:
    """speed or memory."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--baseline-rev", required=True, help="the commit with the in-memory data path")
    s.add_argument("--runs", type=int, default=5)
    m = sub.add_parser("memory")
    m.add_argument("--small", type=Path, required=True, help="a data directory prepared from a small corpus")
    m.add_argument("--large", type=Path, required=True, help="the same, from a large corpus")
    m.add_argument("--steps", type=int, default=100)
    for q in (s, m):
        q.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    report = speed(args) if args.what == "speed" else memory(args)
    save_report(args.json, report)


if __name__ == "__main__":
    main()
