"""Sanity tasks (`qkv train copy`, `qkv train reverse`): the Annotated Transformer's copy task, and reversal.

They run the same loop, batching, loss and decoding as translation, so a bug in any of them shows up
here in seconds: a correct model reproduces held-out sequences exactly (100 % exact match).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from qkv.attention import MultiHeadAttentionConfig
from qkv.blocks import BlockConfig, FeedForwardConfig, StackConfig
from qkv.config import option
from qkv.errors import QkvError
from qkv.models import EmbeddingConfig, Transformer, TransformerConfig
from qkv.positional import SinusoidalPositionsConfig
from qkv.tasks.base import EvalOptions, LoadedRun
from qkv.training import Evaluation, RunConfig, Task, TrainResult
from qkv.training.config import DataConfig, EvalConfig, OptimConfig, ScheduleConfig, SystemConfig
from qkv.translation.batching import Seq2SeqBatch, Specials, make_batch, source_tensor
from qkv.translation.decoding import greedy_decode
from qkv.translation.step import batch_logits, evaluate_batches, label_smoothed_loss

SPECIALS = Specials(pad=0, bos=1, eos=2)
FIRST_DIGIT = 3  # digit d is token FIRST_DIGIT + d


@dataclass(frozen=True, kw_only=True)
class CopyConfig(RunConfig[TransformerConfig]):
    """How to train the copy task: random digit sequences; the target is the source itself."""

    task: ClassVar[str] = "copy"
    model_class: ClassVar[type[TransformerConfig]] = TransformerConfig

    length: int = option(10, "sequence length (the longest, with --min-length)", fixed=True)
    min_length: int | None = option(None, "the shortest sequence length (default: all of --length)", fixed=True)
    n_symbols: int = option(10, "distinct digits", fixed=True)
    n_test: int = option(1000, "held-out sequences the evaluation decodes")

    def check(self) -> None:
        """The shared checks, then the lengths."""
        super().check()
        shortest = self.length if self.min_length is None else self.min_length
        if not 1 <= shortest <= self.length or self.n_symbols < 1 or self.n_test < 1:
            raise QkvError(f"need 1 ≤ min-length ≤ length and positive n-symbols, n-test; got min-length {shortest}, "
                           f"length {self.length}, n-symbols {self.n_symbols}, n-test {self.n_test}")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ReverseConfig(CopyConfig):
    """How to train the reverse task: the target is the source backwards."""

    task: ClassVar[str] = "reverse"


def recipe(cls: type[CopyConfig] = CopyConfig) -> CopyConfig:
    """A small encoder–decoder (2 + 2 pre-norm layers × 64 wide, no dropout: the task is noise-free), AdamW without
    weight decay, on one thread (two only wait on each other over such small matrices)."""
    block = BlockConfig(attention=MultiHeadAttentionConfig(n_heads=4, dropout=0.0),
                        ffn=FeedForwardConfig(d_ff=256, dropout=0.0), norm_placement="pre", dropout=0.0)  # fmt: skip
    side = StackConfig(n_layers=2, block=block)
    model = TransformerConfig(d_model=64, max_positions=64, embedding=EmbeddingConfig(
        positions=SinusoidalPositionsConfig(), scale=True, dropout=0.0), encoder=side, decoder=side)  # fmt: skip
    return cls(model=model, data=DataConfig(batch_size=64),
               optim=OptimConfig(beta2=0.98, weight_decay=0.0, fused=False),
               schedule=ScheduleConfig(max_steps=300, min_lr=3e-4), eval=EvalConfig(interval=300),
               system=SystemConfig(cpu_threads=1, seed=0))  # fmt: skip


def reverse_recipe() -> CopyConfig:
    """The copy task's recipe, reversing."""
    return recipe(ReverseConfig)


def random_sequences(n: int, length: int, n_symbols: int, gen: torch.Generator) -> list[list[int]]:
    """n random digit sequences as token ids."""
    return (torch.randint(0, n_symbols, (n, length), generator=gen) + FIRST_DIGIT).tolist()


class ToyTask(Task):
    """Copy or reverse a digit sequence; the held-out exact-match rate keeps the best weights."""

    name = "copy"
    best_metric = "val_exact_match"
    higher_is_better = True

    def __init__(self, cfg: CopyConfig) -> None:
        super().__init__(cfg)
        self.cfg: CopyConfig = cfg
        self.test: list[list[int]] = []

    def target_of(self, seq: list[int]) -> list[int]:
        """The expected output for a source sequence."""
        return list(seq)

    def setup(self, run_dir: Path, resume: bool) -> None:
        """The held-out sequences (from their own seed: never a training batch)."""
        cfg = self.cfg
        seed = torch.Generator().manual_seed(cfg.system.seed + 1)
        self.test = random_sequences(cfg.n_test, cfg.length, cfg.n_symbols, seed)

    def model_config(self) -> TransformerConfig:
        """An encoder–decoder over <pad> <s> </s> and the digits."""
        vocab = FIRST_DIGIT + self.cfg.n_symbols
        return replace(self.cfg.model, src_vocab_size=vocab, tgt_vocab_size=vocab, share_embeddings=True,
                       pad_id=SPECIALS.pad)  # fmt: skip

    def describe(self) -> str:
        """The sequences."""
        lengths = self.cfg.length if self.cfg.min_length is None else f"{self.cfg.min_length}–{self.cfg.length}"
        return f"sequences of {lengths} digits out of {self.cfg.n_symbols}, {self.cfg.n_test:,} held out"

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> list[list[int]]:
        """`budget` random sequences (of random lengths with min_length)."""
        cfg = self.cfg
        sequences = random_sequences(budget, cfg.length, cfg.n_symbols, generator)
        if cfg.min_length is None:
            return sequences
        lengths = torch.randint(cfg.min_length, cfg.length + 1, (budget,), generator=generator).tolist()
        return [seq[:n] for seq, n in zip(sequences, lengths, strict=True)]

    def collate(self, examples: Sequence[Any], device: torch.device) -> Seq2SeqBatch:
        """Source, and the target (the same or reversed) for teacher forcing."""
        return make_batch(examples, [self.target_of(s) for s in examples], SPECIALS).to(device)

    def logits(self, model: Callable[..., Any], batch: Seq2SeqBatch) -> Tensor:
        """Teacher-forced logits (B, T, V) of the target."""
        return batch_logits(model, batch)

    def criterion(self, logits: Tensor, batch: Seq2SeqBatch) -> Tensor:
        """Cross-entropy per target token."""
        return label_smoothed_loss(logits, batch.tgt_out, batch.pad, smoothing=0.0)

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """Teacher-forced loss and greedy exact match on the held-out sequences."""
        assert isinstance(ev.model, Transformer)
        batch = make_batch(self.test, [self.target_of(s) for s in self.test], SPECIALS).to(ev.ctx.device)
        with ev.autocast():
            loss = evaluate_batches(ev.forward, [batch])
        return {"val_loss": loss, "val_exact_match": exact_match(ev.model, self.test, self.target_of)}

    def summary(self, result: TrainResult) -> str:
        """The held-out exact-match rate."""
        return (f"\nexact match {result.final['val_exact_match']:.1%} on {self.cfg.n_test:,} held-out sequences after "
                f"{result.step} steps, {result.took()} — run saved in {result.run_dir}")  # fmt: skip


class ReverseTask(ToyTask):
    """The reverse task."""

    name = "reverse"

    def target_of(self, seq: list[int]) -> list[int]:
        """The source backwards."""
        return seq[::-1]


def exact_match(model: Transformer, sources: list[list[int]], target_of: Callable[[list[int]], list[int]]) -> float:
    """Fraction of sources whose greedy output equals the expected target exactly."""
    device = next(model.parameters()).device
    src = source_tensor(sources, SPECIALS).to(device)
    outputs = greedy_decode(model, src, SPECIALS, max_len=max(len(s) for s in sources) + 2)
    return sum(out == target_of(s) for out, s in zip(outputs, sources, strict=True)) / len(sources)


@dataclass
class ToyRun(LoadedRun):
    """A trained copy or reverse model."""

    model: Transformer
    config: CopyConfig
    config_class: ClassVar[type[RunConfig[Any]]] = CopyConfig

    def evaluate(self, options: EvalOptions) -> list[str]:
        """Exact match on the held-out sequences."""
        options.refuse_beam_options(self.task)
        task = (ReverseTask if self.task == "reverse" else ToyTask)(self.config)
        task.setup(self.directory, resume=False)
        rate = exact_match(self.model, task.test, task.target_of)
        return [f"exact match {rate:.1%} on {len(task.test):,} held-out sequences ({self.checkpoint} weights)"]


@dataclass
class ReverseRun(ToyRun):
    """A trained reverse model."""

    config_class: ClassVar[type[RunConfig[Any]]] = ReverseConfig
