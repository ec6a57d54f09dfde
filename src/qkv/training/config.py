"""TrainConfig: everything a training run needs besides the model config, validated up front."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkv.config import DecoderLMConfig
from qkv.errors import QkvError
from qkv.training.schedule import SCHEDULE_KINDS

DTYPES = ("float32", "bfloat16", "float16")
TOKENIZERS = ("char", "bpe")
STRATEGIES = ("ddp", "fsdp")  # how several processes (torchrun, --nproc) share the work

# The default recipe is a speedrun (benchmarks/SPEEDRUN.md): the fastest way found on a 2-core CPU to
# full-validation loss 1.96 on the embedded Shakespeare, the level nanoGPT's CPU recipe reaches in
# 2,000 steps. nanoGPT's 4 layers × 128 with a modern block (rotary positions, RMSNorm, SwiGLU, no
# biases), windows of 128 characters in batches of 8, a 3× higher peak learning rate, and a cosine
# schedule as long as the run: 600 steps, ≈ 30 s of training, full-val loss ≈ 1.94.
DEFAULT_MODEL: dict[str, Any] = {
    "n_layers": 4,
    "d_model": 128,
    "n_heads": 4,
    "positions": "rotary",
    "norm": "rms",
    "activation": "swiglu",
    "bias": False,
    "dropout": 0.0,
}


@dataclass(kw_only=True)
class TrainConfig:
    """How to train: data, tokenizer, batch shape, optimiser, schedule, budget, device, output."""

    data: str | None = None  # a UTF-8 text file; None = the embedded Shakespeare corpus
    tokenizer: str = "char"
    bpe_vocab_size: int = 1024
    model: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))  # DecoderLMConfig fields
    block_size: int = 128
    batch_size: int = 8  # per process: a run on N processes takes N·batch_size sequences per micro-batch
    grad_accum: int = 1
    max_steps: int = 600
    max_time: float | None = None  # seconds; stop early (and save) when the budget is spent
    lr: float = 3e-3
    min_lr: float | None = None  # None = lr / 20
    warmup_steps: int = 100
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 = no clipping
    eval_interval: int = 300  # each full-split evaluation costs ≈ 2 s of a ≈ 45 s default run
    eval_tokens: int | None = None  # periodic evals read this many val tokens; None = all (final eval always all)
    device: str = "auto"
    dtype: str = "float32"
    compile: bool = False
    strategy: str = "ddp"  # ddp: every rank holds the whole model; fsdp: parameters sharded across ranks
    dist_timeout: float = 60.0  # seconds a collective may wait for a dead or hung peer before failing
    seed: int = 1337
    out_dir: str | None = None  # None = runs/<data>-<tokenizer>-<timestamp>
    resume: bool = False
    sample_tokens: int = 400  # length of the sample printed after training (0 = none)

    def __post_init__(self) -> None:
        """Refuse impossible settings with a message naming the setting."""
        if self.tokenizer not in TOKENIZERS:
            raise QkvError(f"unknown tokenizer {self.tokenizer!r}; choose one of: {', '.join(TOKENIZERS)}")
        if self.schedule not in SCHEDULE_KINDS:
            raise QkvError(f"unknown schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULE_KINDS)}")
        if self.strategy not in STRATEGIES:
            raise QkvError(f"unknown strategy {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
        if self.dist_timeout <= 0:
            raise QkvError(f"dist-timeout must be positive seconds, got {self.dist_timeout}")
        if self.dtype not in DTYPES:
            raise QkvError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
        for name in ("block_size", "batch_size", "grad_accum", "max_steps", "eval_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise QkvError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "sample_tokens"):
            if getattr(self, name) < 0:
                raise QkvError(f"{name.replace('_', '-')} must be ≥ 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise QkvError(f"lr must be positive, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise QkvError(f"min-lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.max_time is not None and self.max_time <= 0:
            raise QkvError(f"max-time must be positive seconds, got {self.max_time}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise QkvError("grad-clip and weight-decay must be ≥ 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise QkvError(f"betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if self.eval_tokens is not None and self.eval_tokens < 2:
            raise QkvError(f"eval-tokens must be ≥ 2, got {self.eval_tokens}")
        if not isinstance(self.model, dict):
            raise QkvError(f"model must be a dict of DecoderLMConfig fields, got {type(self.model).__name__}")
        self.model = {**DEFAULT_MODEL, **self.model}  # settings given override the default recipe's
        if self.data is not None:
            self.data = str(Path(self.data).expanduser().resolve())  # so eval/resume work from any directory
        known = {f.name for f in dataclasses.fields(DecoderLMConfig)}
        unknown = sorted(set(self.model) - known)
        if unknown:
            names = ", ".join(map(str, unknown))
            raise QkvError(f"unknown model field(s): {names}; see DecoderLMConfig for the fields")
        if "vocab_size" in self.model:
            raise QkvError("the model's vocab_size comes from the tokenizer; use --vocab-size (bpe) instead")

    @property
    def final_lr(self) -> float:
        """The learning rate at the end of the schedule."""
        return self.lr / 20 if self.min_lr is None else self.min_lr

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from config.json's "training" entry, refusing unknown keys."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise QkvError(f"unknown training setting(s): {', '.join(unknown)}")
        return cls(**data)
