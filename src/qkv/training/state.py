"""The counters a checkpoint stores beside the weights and the optimiser, and a resumed run continues from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkv.io.run_dir import migrate_state


@dataclass
class RunState:
    """Where a run stands: its step, what it has read, how long it took, and its best score."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_before: float = 0.0  # wall-clock seconds of earlier sessions of this run
    overhead_s: float = 0.0  # seconds spent evaluating and checkpointing, all sessions
    best: float | None = None
    global_batch: int = 0  # batch_size × processes of the run's first session, kept on resume

    @classmethod
    def of(cls, extra: dict[str, Any], batch_size: int) -> RunState:
        """The state a checkpoint stored (any version's layout; a run before global batches: batch_size)."""
        extra = migrate_state(extra)
        return cls(extra["step"], extra["tokens_seen"], extra["elapsed_s"], extra["elapsed_s"] - extra["train_s"],
                   extra["best"], extra.get("global_batch_size", batch_size))  # fmt: skip

    def extra(self, elapsed_s: float, train_s: float) -> dict[str, Any]:
        """What a checkpoint stores of this state, after elapsed_s seconds (train_s of them training)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": elapsed_s, "train_s": train_s,
                "best": self.best, "global_batch_size": self.global_batch}  # fmt: skip
