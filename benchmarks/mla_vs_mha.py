"""Plot the loss curves of an MHA run and an MLA run of `qkv train` (docs/images/mla-vs-mha.png).

The figure in the docs comes from two runs of the then-default recipe (4 layers × 128, 4 heads of 32, block 64,
batch 12, peak lr 2e-3), identical except for the attention, 300 steps on the embedded Shakespeare corpus, one thread:

    qkv train --max-steps 300 --eval-interval 50 --seed 1337 --sample-tokens 0 --block-size 64 --batch-size 12 \\
        --lr 2e-3 --out-dir runs/mha
    qkv train --max-steps 300 --eval-interval 50 --seed 1337 --sample-tokens 0 --block-size 64 --batch-size 12 \\
        --lr 2e-3 --out-dir runs/mla --model attention=mla --model kv_lora_rank=64 --model qk_rope_head_dim=16
    python benchmarks/mla_vs_mha.py runs/mha runs/mla --out docs/images/mla-vs-mha.png

MLA there caches 64 + 16 = 80 numbers per token and layer, MHA 2 · 128 = 256.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluations a run logged in metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Validation (solid) and training (dashed) loss of each run against optimiser steps."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for (label, metrics), color in zip(runs.items(), ("tab:blue", "tab:orange"), strict=False):
        steps = [m["step"] for m in metrics]
        ax.plot(steps, [m["val_loss"] for m in metrics], marker="o", ms=3, color=color, label=f"{label} validation")
        train = [m["train_loss"] for m in metrics]  # the mean over the steps since the previous evaluation
        ax.plot(steps, train, ls="--", color=color, alpha=0.6, label=f"{label} train (mean since last eval)")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("cross-entropy loss (nats / char)")
    ax.set_title("Multi-head latent attention vs multi-head attention (Shakespeare, 4 × 128)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    """Read the two runs, plot them, print their final validation losses."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mha_run", type=Path)
    parser.add_argument("mla_run", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/images/mla-vs-mha.png"))
    args = parser.parse_args()
    runs = {"MHA": read_metrics(args.mha_run), "MLA": read_metrics(args.mla_run)}
    plot(runs, args.out)
    for label, metrics in runs.items():
        print(f"{label}: final val loss {metrics[-1]['val_loss']:.4f} at step {metrics[-1]['step']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
