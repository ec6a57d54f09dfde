"""The language-model task (`qkv train`, the default): a decoder-only Transformer predicts the next token.

Data: the embedded Shakespeare corpus or a UTF-8 text file, split by characters (first 90 % train,
last 10 % validation), character- or BPE-tokenised. Batches are random windows of block_size tokens;
the loss is the mean next-token cross-entropy; the evaluation is the whole validation split cut into
consecutive windows, every position predicted once (qkv.training.evaluate), which is what `qkv eval`
reports too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.config import DecoderLMConfig
from qkv.data.batches import random_starts, windows_at
from qkv.data.text import TextData, prepare_text_data
from qkv.errors import QkvError
from qkv.generation import Sampling, stream
from qkv.models import DecoderLM
from qkv.tasks.base import EvalOptions, LoadedRun
from qkv.tasks.text import TextConfig, check_window_fits
from qkv.tokenizers import load_tokenizer
from qkv.training import Evaluation, RunConfig, Task, TrainResult, evaluate_loss, option, perplexity
from qkv.training.config import OPTIMIZERS
from qkv.training.distributed import sharded_eval_loss

# The default recipe is a speedrun (benchmarks/SPEEDRUN.md): the fastest way found on a 2-core CPU to the
# full-validation loss nanoGPT's CPU recipe ends at on the embedded Shakespeare (1.96): nanoGPT's width (128)
# with a modern block, three layers instead of four and one key/value head (multi-query attention: fewer
# multiply-adds per token), Muon for the blocks' matrices at a high learning rate, windows of 128 characters
# in batches of 8 and a cosine schedule as long as the run; periodic evaluations read a sample of the
# validation split, the last one all of it.
DEFAULT_MODEL: dict[str, Any] = {
    "n_layers": 3,
    "d_model": 128,
    "n_heads": 4,
    "n_kv_heads": 1,
    "positions": "rotary",
    "norm": "rms",
    "activation": "swiglu",
    "bias": False,
    "dropout": 0.0,
}


@dataclass(kw_only=True)
class LMConfig(TextConfig):
    """How to train a language model: the shared settings plus its text, tokenizer, context and sample."""

    task: ClassVar[str] = "lm"
    model_config: ClassVar[type[DecoderLMConfig]] = DecoderLMConfig
    default_model: ClassVar[dict[str, Any]] = DEFAULT_MODEL
    newton_schulz_steps: ClassVar[int] = 4  # as good as 5 here, and 6 % faster a step (benchmarks/SPEEDRUN.md)

    model: dict[str, Any] = option(factory=dict, help="DecoderLMConfig fields over the recipe's", fixed=True)
    tokenizer: str = option("char", "char, or bpe (byte-level BPE trained on the train split)", fixed=True,
                            choices=("char", "bpe"))  # fmt: skip
    vocab_size: int = option(1024, "the BPE vocabulary's size (bpe only)", fixed=True)
    block_size: int = option(128, "context length in tokens", fixed=True)
    max_steps: int = option(350, "optimiser steps (the schedule's length)")
    lr: float = option(1e-2, "peak learning rate")
    optimizer: str = option("muon", "adamw, or muon: Muon for the blocks' matrices, AdamW for the rest", fixed=True,
                            choices=OPTIMIZERS)  # fmt: skip
    eval_interval: int = option(100, "steps between evaluations and checkpoints")
    eval_tokens: int | None = option(8192, "validation tokens read by periodic evaluations (none: all; the "
                                     "last evaluation reads all)")  # fmt: skip
    sample_tokens: int = option(400, "tokens sampled when training ends (0 = none)")

    def __post_init__(self) -> None:
        """The shared checks, then the language model's own."""
        super().__post_init__()
        if self.eval_tokens is not None and self.eval_tokens < 2:
            raise QkvError(f"eval-tokens must be ≥ 2, got {self.eval_tokens}")
        if self.sample_tokens < 0:
            raise QkvError(f"sample-tokens must be ≥ 0, got {self.sample_tokens}")


@dataclass
class LMBatch:
    """Windows x (B, T) and their next tokens y (B, T): every position is a target."""

    x: Tensor
    y: Tensor

    @property
    def n_targets(self) -> int:
        """B · T."""
        return self.y.numel()

    @property
    def n_tokens(self) -> int:
        """B · T."""
        return self.x.numel()


class LMTask(Task):
    """Next-token prediction with a DecoderLM."""

    name = "lm"

    def __init__(self, cfg: LMConfig, stored_model: dict[str, Any] | None = None) -> None:
        super().__init__(cfg, stored_model)
        self.cfg: LMConfig = cfg
        self.data: TextData | None = None

    @classmethod
    def run_name(cls, cfg: RunConfig) -> str:
        """<data file name, or shakespeare>-<tokenizer>."""
        assert isinstance(cfg, LMConfig)
        return f"{cfg.text_name()}-{cfg.tokenizer}"

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Tokenize the text (with the run's own tokenizer on resume) and check the context fits."""
        cfg = self.cfg
        stored = load_tokenizer(run_dir) if resume else None
        size = cfg.vocab_size if cfg.tokenizer == "bpe" else None
        self.data = prepare_text_data(cfg.data, cfg.tokenizer, size, stored)
        self.tokenizer = self.data.tokenizer
        check_window_fits(cfg.block_size, self.data.train_ids)

    def new_model_config(self) -> DecoderLMConfig:
        """A DecoderLM over the tokenizer's vocabulary with a context of block_size tokens."""
        assert self.tokenizer is not None
        model_cfg = self.cfg.build_model_config(vocab_size=self.tokenizer.vocab_size, max_positions=self.cfg.block_size)
        assert isinstance(model_cfg, DecoderLMConfig)
        if model_cfg.max_positions < self.cfg.block_size:
            raise QkvError(f"model max_positions={model_cfg.max_positions} is smaller than the block size "
                           f"{self.cfg.block_size}; drop --model max_positions or lower --block-size")  # fmt: skip
        return model_cfg

    def describe(self) -> str:
        """Token counts and the vocabulary."""
        assert self.data is not None
        d = self.data
        return f"{len(d.train_ids):,} train / {len(d.val_ids):,} val tokens, vocab {d.tokenizer.vocab_size}"

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> Tensor:
        """`budget` random window starts in the training split."""
        assert self.data is not None
        return random_starts(len(self.data.train_ids), self.cfg.block_size, budget, generator)

    def collate(self, examples: Sequence[Any], device: torch.device) -> LMBatch:
        """The windows at these starts."""
        assert self.data is not None and isinstance(examples, Tensor)
        return LMBatch(*windows_at(self.data.train_ids, examples, self.cfg.block_size, device))

    def loss(self, model: Callable[..., Any], batch: LMBatch) -> Tensor:
        """Mean next-token cross-entropy (computed in float32 whatever the autocast dtype)."""
        logits = model(batch.x)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), batch.y.flatten())

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """The validation loss by `qkv eval`'s protocol (periodically over eval_tokens tokens, if set)."""
        assert self.data is not None
        max_tokens = None if ev.full else self.cfg.eval_tokens
        with ev.autocast():
            loss = sharded_eval_loss(ev.forward, self.data.val_ids, self.cfg.block_size, self.cfg.batch_size,
                                     ev.ctx, max_tokens)  # fmt: skip
        return {"val_loss": loss}

    @property
    def partial_evaluation(self) -> bool:
        """Periodic evaluations read only eval_tokens tokens when that is set."""
        return self.cfg.eval_tokens is not None

    def summary(self, result: TrainResult) -> str:
        """The final validation loss and perplexity, a sample of the best weights, and what to try next."""
        loss = result.val_loss
        lines = [f"\nvalidation loss {loss:.4f} (perplexity {perplexity(loss):.2f}) after {result.step} steps, "
                 f"{result.elapsed_s:.0f} s — run saved in {result.run_dir}"]  # fmt: skip
        if self.cfg.sample_tokens > 0:
            run = LMRun.load(result.run_dir)
            tokenizer = run.require_tokenizer()
            prompt = "\n" if "\n" in getattr(tokenizer, "chars", "\n") else tokenizer.decode([0])
            sample = run.generate(prompt, self.cfg.sample_tokens, temperature=0.8, seed=self.cfg.seed)
            lines += ["\n--- sample " + "-" * 60, sample, "-" * 71]
        run_dir = result.run_dir
        lines.append(f"more: qkv generate {run_dir} --prompt 'ROMEO:'  |  qkv eval {run_dir}  |  qkv explore {run_dir}")
        return "\n".join(lines)


@dataclass
class LMRun(LoadedRun):
    """A trained language model: generate text, or measure the validation loss."""

    model: DecoderLM
    config: LMConfig
    config_class: ClassVar[type[RunConfig]] = LMConfig

    def generate(self, prompt: str, max_new_tokens: int = 200, **sampling: Any) -> str:
        """The prompt's continuation as text; sampling: Sampling's fields (temperature 0.8 unless given)."""
        tokenizer = self.require_tokenizer()
        ids = tokenizer.encode_tensor(prompt)[None, :].to(self.device)
        steps = stream(self.model, ids, max_new_tokens, Sampling(**{"temperature": 0.8, **sampling}),
                       eos_id=tokenizer.eos_id)  # fmt: skip
        tokens = [int(t) for t in torch.stack(list(steps))[:, 0].tolist()] if max_new_tokens else []
        eos = tokenizer.eos_id
        return tokenizer.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens)

    def validation_data(self) -> TextData:
        """The run's validation split, tokenised as in training."""
        cfg = self.config
        return prepare_text_data(cfg.data, cfg.tokenizer, cfg.vocab_size, self.require_tokenizer())

    def evaluate(self, options: EvalOptions) -> list[str]:
        """Loss and perplexity over the whole validation split, in windows of the training block size."""
        options.refuse_beam_options(self.task)
        data = self.validation_data()
        block_size = self.config.block_size  # the windows training evaluated on, whatever the model allows
        loss = evaluate_loss(self.model, data.val_ids, block_size, options.batch_size, self.device)
        return [f"val loss {loss:.4f}  perplexity {perplexity(loss):.3f}  ({len(data.val_ids) - 1:,} positions, "
                f"block size {block_size}, {self.checkpoint} weights)"]  # fmt: skip
