"""The speedrun, side by side: nanoGPT's own train.py and `qkv train` on the same text, timed by the same clock.

nanoGPT (its public repository, unmodified) runs the CPU recipe from its README on qkv's embedded Shakespeare,
written in its shakespeare_char format (train.bin / val.bin / meta.pkl, the same 90 / 10 character split qkv
uses). Its final validation loss (the mean over eval_iters batches at the last iteration) is the target. Then
`qkv train` runs with its defaults (plus --qkv-arg options) and is judged on its full-validation-split loss (the
`qkv eval` protocol): the first evaluation over the whole split at or below the target.

Both clocks start when the process is launched and stop when the line reporting that evaluation is printed, so
start-up, data preparation and every evaluation on the way are counted for both. Runs alternate (nanoGPT,
qkv, nanoGPT, qkv, …) so that a slow spell of a shared machine falls on both.

    python benchmarks/speedrun.py --nanogpt ~/src/nanoGPT                 # a checkout, or a git directory
    python benchmarks/speedrun.py --nanogpt ~/src/nanoGPT --runs 2 --json speedrun.json
    python benchmarks/speedrun.py --nanogpt ~/src/nanoGPT --qkv-arg=--optimizer=adamw
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qkv.bench import save_report
from qkv.data.cache import open_text
from qkv.io.run_dir import read_metrics

# nanoGPT's README: "a baby GPT on the CPU" (its config file, with these overrides).
NANOGPT_CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                      "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                      "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]  # fmt: skip
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
QKV_EVAL = re.compile(r"^step\s+(\d+)\s+train\s+[\d.]+\s+val\s+([\d.]+)")


def timed_lines(command: list[str], cwd: Path) -> tuple[list[tuple[float, str]], int]:
    """Run command; each line of its output (stdout and stderr together) with the seconds since launch."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = [(time.monotonic() - began, line.rstrip("\n")) for line in proc.stdout]
    return lines, proc.wait()


def prepare_nanogpt(source: Path, work: Path) -> Path:
    """An unmodified copy of nanoGPT in work/nanoGPT, with qkv's Shakespeare as its shakespeare_char data."""
    import numpy as np

    dest = work / "nanoGPT"
    if (source / "train.py").is_file():
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".git", "out-*"))
    else:  # a git directory (a bare mirror): its HEAD's files
        dest.mkdir()
        archive = subprocess.run(["git", "--git-dir", str(source), "archive", "HEAD"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    if not (dest / "train.py").is_file():
        raise SystemExit(f"speedrun.py: {source} holds no nanoGPT train.py (give a checkout or its git directory)")
    data = open_text(None)
    out = dest / "data" / "shakespeare_char"
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):  # nanoGPT's files are the tokens alone, without llm.c's header
        tokens = data.split(split)
        np.asarray(tokens[0 : len(tokens)], dtype=np.uint16).tofile(out / f"{split}.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": data.tokenizer.vocab_size}, f)
    return dest


def run_nanogpt(checkout: Path, out_dir: Path) -> dict[str, Any]:
    """nanoGPT's CPU recipe: its final validation loss and the seconds from launch to the line reporting it."""
    lines, code = timed_lines([sys.executable, "train.py", *NANOGPT_CPU_RECIPE, f"--out_dir={out_dir}"], checkout)
    evals = [(t, m) for t, line in lines if (m := NANOGPT_EVAL.match(line))]
    if code != 0 or not evals:
        tail = "\n".join(line for _, line in lines[-20:])
        raise SystemExit(f"speedrun.py: nanoGPT's train.py failed (exit {code}):\n{tail}")
    seconds, last = evals[-1]
    return {"final_val_loss": float(last.group(3)), "step": int(last.group(1)), "seconds": round(seconds, 2)}


def run_qkv(target: float, out_dir: Path, extra: list[str]) -> dict[str, Any]:
    """Default `qkv train`: seconds from launch to the first full-split evaluation at or below target."""
    command = [sys.executable, "-m", "qkv", "train", "--out-dir", str(out_dir), *extra]
    lines, code = timed_lines(command, out_dir.parent)
    if code != 0:
        tail = "\n".join(line for _, line in lines[-20:])
        raise SystemExit(f"speedrun.py: qkv train failed (exit {code}):\n{tail}")
    printed = {int(m.group(1)): t for t, line in lines if (m := QKV_EVAL.match(line))}
    rows = [r for r in read_metrics(out_dir) if r.get("full_eval", True)]
    hit = next((r for r in rows if r["val_loss"] <= target), None)
    return {
        "reached": hit is not None, "step": hit["step"] if hit else None,
        "seconds": round(printed[hit["step"]], 2) if hit else None,
        "full_evals": [(r["step"], round(r["val_loss"], 4)) for r in rows],
        "final_val_loss": rows[-1]["val_loss"] if rows else None, "total_seconds": round(lines[-1][0], 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> float:
    """Run both side by side --runs times; print each pair and the ratio; return the median ratio."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout or git directory")
    p.add_argument("--runs", type=int, default=1, help="pairs of runs, alternating")
    p.add_argument("--qkv-arg", action="append", default=[], help="an extra `qkv train` option (repeatable)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checkout = prepare_nanogpt(args.nanogpt.expanduser(), work)
        for i in range(args.runs):
            nano = run_nanogpt(checkout, work / f"nanogpt-out-{i}")
            print(f"run {i + 1}: nanoGPT   val {nano['final_val_loss']:.4f} at iteration {nano['step']} "
                  f"after {nano['seconds']:.1f} s", flush=True)  # fmt: skip
            ours = run_qkv(nano["final_val_loss"], work / f"qkv-{i}", args.qkv_arg)
            if ours["reached"]:
                ratio = ours["seconds"] / nano["seconds"]
                print(f"run {i + 1}: qkv train full-val ≤ {nano['final_val_loss']:.4f} at step {ours['step']} "
                      f"after {ours['seconds']:.1f} s  →  {ratio:.3f} × nanoGPT's time", flush=True)  # fmt: skip
            else:
                ratio = float("inf")
                print(f"run {i + 1}: qkv train never reached {nano['final_val_loss']:.4f} (full-split evaluations: "
                      f"{ours['full_evals']})", flush=True)  # fmt: skip
            pairs.append({"nanogpt": nano, "qkv": ours, "ratio": ratio})
    median = statistics.median(pair["ratio"] for pair in pairs)
    print(f"\nqkv's time to nanoGPT's final validation loss: {median:.3f} × nanoGPT's (median of {len(pairs)})")
    save_report(args.json, {"runs": pairs, "median_ratio": median, "nanogpt_recipe": NANOGPT_CPU_RECIPE,
                            "qkv_args": args.qkv_arg})  # fmt: skip
    return median


if __name__ == "__main__":
    main()
