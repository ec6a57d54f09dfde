"""The induction experiment's training task: rows of a random block repeated, a 2-layer attention-only model,
and an evaluation that measures both halves of held-out rows and the strongest heads (qkv.lab.induction says why
the recipe is what it is)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention import MultiHeadAttentionConfig
from qkv.blocks import BlockConfig, FeedForwardConfig, StackConfig
from qkv.config import option
from qkv.errors import QkvError
from qkv.interpret.induction import head_scores, repeated_tokens
from qkv.models import DecoderLMConfig, EmbeddingConfig
from qkv.positional import RotaryPositionsConfig
from qkv.tasks.lm import LMBatch, NextToken
from qkv.training import Evaluation, RunConfig, Task
from qkv.training.config import DataConfig, EvalConfig, OptimConfig, ScheduleConfig, SystemConfig


@dataclass(frozen=True, kw_only=True)
class InductionConfig(RunConfig[DecoderLMConfig]):
    """How to train the induction model: rows of a random block repeated, its length drawn per row."""

    task: ClassVar[str] = "induction"
    model_class: ClassVar[type[DecoderLMConfig]] = DecoderLMConfig

    length: int = option(25, "tokens repeated in the evaluation rows; the longest repeat in training", fixed=True)
    min_length: int = option(10, "the shortest repeat in training", fixed=True)
    vocab: int = option(128, "distinct random tokens", fixed=True)
    n_eval: int = option(64, "held-out rows the evaluation reads")

    def check(self) -> None:
        """The shared checks, then the lengths and the vocabulary."""
        super().check()
        if self.length < 2:
            raise QkvError(f"length must be ≥ 2 (one token repeated leaves nothing to predict), got {self.length}")
        if not 2 <= self.min_length <= self.length:
            raise QkvError(f"min-length must be between 2 and length ({self.length}), got {self.min_length}")
        if self.vocab < 2 or self.n_eval < 1:
            raise QkvError(f"vocab must be ≥ 2 and n-eval ≥ 1, got {self.vocab} and {self.n_eval}")


def recipe() -> InductionConfig:
    """2 attention-only layers of 4 heads, rotary positions and untied embeddings (the module docstring says why), no
    dropout (the task is noise-free), on one thread of the CPU."""
    block = BlockConfig(attention=MultiHeadAttentionConfig(n_heads=4, dropout=0.0), ffn=FeedForwardConfig(d_ff=0),
                        norm_placement="pre", dropout=0.0)  # fmt: skip
    model = DecoderLMConfig(d_model=64, embedding=EmbeddingConfig(positions=RotaryPositionsConfig(), dropout=0.0),
                            decoder=StackConfig(n_layers=2, block=block), tie_embeddings=False)  # fmt: skip
    return InductionConfig(model=model, data=DataConfig(batch_size=64), optim=OptimConfig(fused=False),
                           schedule=ScheduleConfig(max_steps=600, warmup_steps=50), eval=EvalConfig(interval=40),
                           system=SystemConfig(device="cpu", cpu_threads=1, seed=0))  # fmt: skip


def training_rows(batch: int, length: int, min_length: int, vocab: int, generator: torch.Generator) -> Tensor:
    """(batch, 2 · length) ids: per row, n random tokens (n drawn from [min_length, length]) repeated to fill it."""
    rows = torch.randint(0, vocab, (batch, 2 * length), generator=generator)
    ns = torch.randint(min_length, length + 1, (batch, 1), generator=generator)  # (B, 1)
    period = torch.arange(2 * length) % ns  # (B, 2 · length): position t holds the row's token t mod n
    return rows.gather(1, period)


def half_losses(logits: Tensor, ids: Tensor) -> tuple[float, float]:
    """Mean next-token loss on the first copy and on the repeated copy of rows [x_1..x_n, x_1..x_n].

    The first copy: predicting x_2..x_n. The repeated copy: predicting its x_2..x_n, each of which follows a
    token seen before (its x_1 follows x_n, whose only earlier occurrence is this one: unpredictable, left out).
    """
    n = ids.shape[1] // 2
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    losses = losses.view(ids.shape[0], -1)  # (B, 2n − 1): position t predicts token t + 1
    return float(losses[:, : n - 1].mean()), float(losses[:, n:].mean())


class InductionTask(NextToken, Task):
    """Next-token prediction on repeated random tokens; the evaluation measures both halves and every head."""

    name = "induction"

    def __init__(self, cfg: InductionConfig) -> None:
        super().__init__(cfg)
        self.cfg: InductionConfig = cfg
        self.eval_ids = torch.zeros(0, dtype=torch.long)

    def setup(self, run_dir: Path, resume: bool) -> None:
        """The held-out rows [x, x] (from their own seed: never a training row)."""
        cfg = self.cfg
        seed = torch.Generator().manual_seed(cfg.system.seed + 1)
        self.eval_ids = repeated_tokens(cfg.n_eval, cfg.length, cfg.vocab, seed)

    def model_config(self) -> DecoderLMConfig:
        """A DecoderLM over the random tokens, with room for one training row."""
        return replace(self.cfg.model, vocab_size=self.cfg.vocab, max_positions=2 * self.cfg.length)

    def describe(self) -> str:
        """The rows."""
        cfg = self.cfg
        return f"blocks of {cfg.min_length}–{cfg.length} random tokens (of {cfg.vocab}) repeated"

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> Tensor:
        """`budget` training rows."""
        cfg = self.cfg
        return training_rows(budget, cfg.length, cfg.min_length, cfg.vocab, generator)

    def collate(self, examples: Any, device: torch.device) -> LMBatch:
        """Inputs and next tokens."""
        return LMBatch(examples[:, :-1].to(device), examples[:, 1:].to(device))

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """Both halves' losses and the strongest heads, on the held-out rows."""
        ids = self.eval_ids.to(ev.ctx.device)
        with ev.autocast():
            logits = ev.forward(ids)  # (B, 2n, V)
        first, repeated = half_losses(logits, ids)
        induction, previous = head_scores(ev.model, ids)  # (L, H) each
        return {"val_loss": float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())),
                "val_first_half": first, "val_repeated_half": repeated,
                "val_induction": float(induction.max()), "val_previous": float(previous.max())}  # fmt: skip
