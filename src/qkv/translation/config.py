"""TranslateConfig: how `qkv train translate` trains (the model itself is a TransformerConfig)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from qkv.errors import QkvError
from qkv.training.schedule import SCHEDULE_KINDS

# Sized for a 2-core CPU, where the budget is ≈ 12 minutes: 2 + 2 layers × 128 wide, 1.44 M parameters with the
# shared 4,000-token vocabulary. Measured there at 2,000 steps with weight decay 0.1: val loss 3.97 in 339 s with
# 2 + 2 layers, 4.03 in 423 s with 3 + 3. Without weight decay, d_model 192 (3 + 3) reached 4.08 in 826 s, d_model
# 128 4.07 in 462 s. On 17,767 pairs the smaller model generalises better and takes more steps in the same time.
DEFAULT_MODEL: dict[str, Any] = {
    "d_model": 128,
    "n_heads": 4,
    "d_ff": 512,
    "n_encoder_layers": 2,
    "n_decoder_layers": 2,
    # Without dropout the cosine run overfits (3 + 3 layers: val loss 3.96 at step 2,000, 4.01 at 3,000, measured);
    # the paper's 0.1 keeps it falling to the end.
    "dropout": 0.1,
    # None on the attention weights, as in the paper: on a CPU that lets the fused attention kernel train, and
    # at 4,800 steps val loss was 3.49 against 3.62 for 4,000 steps with it (see the README).
    "attention_dropout": 0.0,
    "norm_placement": "pre",  # stable at a higher learning rate than the paper's post-norm in short runs
}


@dataclass(kw_only=True)
class TranslateConfig:
    """Data, vocabulary, batch shape, optimiser, schedule, budget, device and output of a translation run."""

    vocab_size: int = 4000  # shared byte-level BPE over both languages
    model: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))  # TransformerConfig fields
    batch_tokens: int = 1500  # padded tokens per side per batch
    max_steps: int = 4400  # ≈ 13 minutes on 2 quiet cores (0.16 s a step); the cosine schedule anneals to min_lr here
    max_time: float | None = 840.0  # seconds, evaluations included: a guard for slower machines (stops and saves)
    lr: float = 3e-3  # high for a Transformer, but the run is short and pre-norm keeps it stable
    min_lr: float = 0.0
    warmup_steps: int = 200
    # The paper's inverse square root never anneals; for a fixed budget, cosine to min_lr reaches a lower
    # loss at the same step (as for the language model: benchmarks/SPEEDRUN.md). `--schedule inverse_sqrt`
    # gives the paper's.
    schedule: str = "cosine"
    # Decoupled (AdamW) decay on matrices: at 2,000 steps val loss 4.03 with 0.1 against 4.07 without (3 + 3 layers).
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98  # the paper's Adam β₂
    grad_clip: float = 1.0
    label_smoothing: float = 0.1  # the paper's ε_ls
    eval_interval: int = 1100  # each evaluation greedy-decodes the 1,000 validation sentences (≈ 15 s)
    beam_size: int = 4
    length_penalty: float = 0.6  # GNMT's α
    # GNMT's β: the penalty for source tokens a hypothesis never attended to. This model's beam outputs ran
    # short (0.77 of the reference length against greedy's 0.92), and it is what evens them out: see the README.
    coverage_penalty: float = 0.2
    device: str = "auto"
    # Intra-op CPU threads; None = PyTorch's default (one per core). On a quiet 2-core machine two threads
    # took 287 steps in 40 s against 187 with one; on a busy one, one thread is faster (each op's threads
    # wait for each other at a barrier while the cores serve other work): pass 1 there.
    cpu_threads: int | None = None
    seed: int = 1337
    out_dir: str | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        """Refuse impossible settings by name."""
        for name in ("vocab_size", "batch_tokens", "max_steps", "eval_interval", "beam_size", "cpu_threads"):
            value = getattr(self, name)
            if name == "cpu_threads" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise QkvError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.lr <= 0 or not 0 <= self.min_lr <= self.lr:
            raise QkvError(f"need 0 ≤ min-lr ≤ lr and lr > 0, got lr={self.lr}, min-lr={self.min_lr}")
        if self.schedule not in SCHEDULE_KINDS:
            raise QkvError(f"unknown schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULE_KINDS)}")
        if not 0 <= self.label_smoothing < 1:
            raise QkvError(f"label smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.max_time is not None and self.max_time <= 0:
            raise QkvError(f"max-time must be positive, got {self.max_time}")
        if self.length_penalty < 0 or self.coverage_penalty < 0:
            raise QkvError(
                f"length and coverage penalties must be ≥ 0, got {self.length_penalty} and {self.coverage_penalty}"
            )
        if self.warmup_steps < 0:
            raise QkvError(f"warmup-steps must be ≥ 0, got {self.warmup_steps}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TranslateConfig:
        """Build from config.json's "training", refusing unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise QkvError(f"unknown TranslateConfig field(s): {', '.join(unknown)}")
        return cls(**data)
