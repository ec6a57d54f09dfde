"""loss.png: train and validation loss curves of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The held-out curve drawn beside the training loss: (legend, y-axis label).
HELD_OUT = {"val_loss": ("validation", "cross-entropy loss (nats / token)"),
            "val_reward": ("held-out reward", "loss, and mean reward"),
            "val_fvu": ("held-out FVU", "held-out fraction of variance unexplained")}


def plot_losses(metrics: list[dict[str, Any]], path: Path, title: str = "Training curves") -> None:
    """Train and val cross-entropy (a GRPO run: its loss and held-out reward; an SAE: its loss and held-out FVU)
    against optimiser steps, written to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works headless and in CI (imported here: `import qkv` stays light)
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, [m["train_loss"] for m in metrics], marker="o", ms=3, label="train")
    key = next((k for k in HELD_OUT if k in metrics[0]), None)  # a GRPO run's evaluation is a reward, an SAE's FVU
    ax.set_xlabel("optimiser step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if key is not None:
        label, axis = HELD_OUT[key]
        # An SAE's loss (normalised units, tens) and its FVU (0–1) need an axis each.
        held = ax.twinx() if key == "val_fvu" else ax
        held.plot(steps, [m[key] for m in metrics], marker="o", ms=3, label=label, color="C1")
        held.set_ylabel(axis)
        if held is not ax:
            ax.set_ylabel("training loss (normalised units)")
            held.legend(loc="upper center")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
