"""loss.png: train and validation loss curves of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The held-out curve drawn beside the training loss: (legend, y-axis label).
HELD_OUT = {"val_loss": ("validation", "cross-entropy loss (nats / token)"),
            "val_reward": ("held-out reward", "loss, and mean reward"),
            "val_fvu": ("held-out FVU", "loss, and held-out fraction of variance unexplained")}


def plot_losses(metrics: list[dict[str, Any]], path: Path, title: str = "Training curves") -> None:
    """Train and val cross-entropy (a GRPO run: its loss and held-out reward; an SAE: its loss and held-out FVU)
    against optimiser steps, written to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works headless and in CI (imported here: `import qkv` stays light)
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, [m["train_loss"] for m in metrics], marker="o", ms=3, label="train")
    key = next(k for k in HELD_OUT if k in metrics[0])  # a GRPO run's evaluation is a reward, an SAE's its FVU
    label, axis = HELD_OUT[key]
    ax.plot(steps, [m[key] for m in metrics], marker="o", ms=3, label=label)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel(axis)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
