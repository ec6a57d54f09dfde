"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): fine-tune a frozen Linear W
through a low-rank update.

    y = x Wᵀ + b + (α / r) · dropout(x) Aᵀ Bᵀ          A: (r, in), B: (out, r), r ≪ min(in, out)

The update ΔW = (α / r) · B A sits beside the frozen weight, on the layer's input: W and b never change, and only
A and B train, r · (in + out) numbers instead of in · out. B starts at zero, so the adapted model starts as the
base model; A starts random (Kaiming-uniform, as PEFT does), so B's first gradient is not zero. The scale α / r
keeps the update's size about the same when r changes: A x has r terms, so without it doubling r would double
what the same learning rate does, and a learning rate tuned at one rank would not carry over to another.

Training never forms ΔW: the extra cost is two thin matmuls per call, and the frozen weight needs no gradient
(the backward pass skips W's, the largest one). `merge_lora` folds ΔW into W once training is done, leaving a
plain nn.Linear: the merged model runs as fast as the base and is saved like any other.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention import LatentAttention
from qkv.config import Config, option
from qkv.errors import QkvError

# Every projection of attention and feed-forward, by qkv's module names (qkv.attention, qkv.blocks.feed_forward).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "gate", "up", "down")
_REGEX_CHARS = set("*+?[]()|^$\\{}")  # a dot alone is a module path (self_attn.q_proj), not a regex


@dataclass(frozen=True, kw_only=True)
class LoRAConfig(Config):
    """Which Linear layers get adapters, of what rank, with what scale α and what dropout on their input."""

    named_errors: ClassVar[bool] = False  # its messages name the flags

    rank: int = option(8, "LoRA: train rank-R adapters beside the frozen weights of --init-from")
    alpha: float | None = option(None, "LoRA's α: the update is scaled by α / rank (none: 2 × rank)")
    dropout: float = option(0.0, "LoRA: dropout on the adapters' input")
    targets: tuple[str, ...] = option(DEFAULT_TARGETS, "LoRA: the Linear layers adapted, comma-separated (a plain name "
                                      "matches a module name's last part, a regex the whole name)")  # fmt: skip

    def check(self) -> None:
        """Refuse a rank below 1, a dropout outside [0, 1), a bad α and an empty or broken target list."""
        if self.rank < 1:
            raise QkvError(f"--lora-rank must be a positive integer, got {self.rank!r}; try 8")
        if not 0.0 <= self.dropout < 1.0:
            raise QkvError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if self.alpha is not None and self.alpha <= 0:
            raise QkvError(f"--lora-alpha must be positive, got {self.alpha}")
        if not self.targets:
            raise QkvError("--lora-targets is empty; name modules, e.g. q_proj,v_proj")
        for pattern in self.targets:
            if _REGEX_CHARS & set(pattern):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise QkvError(f"--lora-targets {pattern!r} is not a valid regex ({e}); fix it or give plain "
                                   "names such as q_proj") from None  # fmt: skip

    @property
    def effective_alpha(self) -> float:
        """α: as given, or 2 × rank."""
        return 2.0 * self.rank if self.alpha is None else self.alpha

    @property
    def scaling(self) -> float:
        """α / r: the factor on B A x."""
        return self.effective_alpha / self.rank

    def apply(self, model: nn.Module) -> list[str]:
        """Freeze the model and put adapters beside its target layers (add_lora); returns their names."""
        return add_lora(model, self)


class LoRALinear(nn.Linear):
    """A frozen nn.Linear plus a trainable low-rank update; state-dict names stay the base's (weight, bias)."""

    def __init__(self, base: nn.Linear, spec: LoRAConfig) -> None:
        nn.Module.__init__(self)  # the base's own Parameters are taken over below, not allocated again
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(spec.rank, self.in_features, device=device, dtype=dtype))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, spec.rank, device=device, dtype=dtype))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's (and PEFT's) initialisation of A
        self.scaling = spec.scaling
        self.lora_dropout = nn.Dropout(spec.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x Wᵀ + b + (α / r) · dropout(x) Aᵀ Bᵀ."""
        down = F.linear(self.lora_dropout(x), self.lora_A) * self.scaling  # (…, r): scaled where it is r wide
        # In place on the base's output, which its backward does not need: no third (…, out) tensor.
        return F.linear(x, self.weight, self.bias).add_(F.linear(down, self.lora_B))  # (…, out)

    def delta(self) -> Tensor:
        """ΔW = (α / r) · B A, (out, in)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def extra_repr(self) -> str:
        """nn.Linear's description plus the rank and scale."""
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def _matches(name: str, pattern: str) -> bool:
    """A plain pattern matches a module name's last parts (q_proj, self_attn.q_proj); a regex, the whole name."""
    if _REGEX_CHARS & set(pattern):
        return re.fullmatch(pattern, name) is not None
    return name == pattern or name.endswith(f".{pattern}")


def target_names(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """The nn.Linear modules inside the model's layers that the patterns select (the output head never)."""
    targets = list(targets)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{name}"]
    found = [name for name in linears if any(_matches(name, p) for p in targets)]
    # The default names every projection any qkv block has: a GELU block has no gate, MLA no k_proj, and that is fine.
    unmatched = [p for p in targets if not any(_matches(name, p) for name in found)]
    if unmatched and (tuple(targets) != DEFAULT_TARGETS or not found):
        have = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in linears}))
        raise QkvError(f"--lora-targets {','.join(unmatched)} match(es) no Linear layer of the model; its layers have "
                       f"{have} (a plain name matches the last part, a regex the whole name)")  # fmt: skip
    return found


def add_lora(model: nn.Module, spec: LoRAConfig) -> list[str]:
    """Freeze every parameter, then put a LoRALinear in place of each target Linear; returns their names."""
    names = target_names(model, spec.targets)
    for name in names:  # layers whose weight is read directly, not called: an adapter there would do nothing
        parent = model.get_submodule(name.rpartition(".")[0])
        if name.endswith("kv_up") and isinstance(parent, LatentAttention) and parent.absorb:
            raise QkvError("--lora-targets kv_up: absorbed MLA reads kv_up's weight directly; target others")
        if name.endswith("router"):
            raise QkvError("--lora-targets router: the MoE router's weight is read directly; target others")
    model.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), spec))
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRA layers by module name (empty: a plain model)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block the model is its frozen base: every adapter's scaling is 0 (for a reference model)."""
    modules = list(lora_modules(model).values())
    kept = [m.scaling for m in modules]
    for m in modules:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(modules, kept, strict=True):
            m.scaling = scaling


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight, W ← W + (α / r) B A, leaving plain nn.Linear layers (in place)."""
    for name, m in lora_modules(model).items():
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.weight.device,
                          dtype=m.weight.dtype)  # fmt: skip
        plain.weight.copy_(m.weight + m.delta().to(m.weight.dtype))
        plain.weight.requires_grad_(m.weight.requires_grad)  # frozen stays frozen: merging changes values only
        if m.bias is not None:
            plain.bias.copy_(m.bias)
            plain.bias.requires_grad_(m.bias.requires_grad)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, plain)
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, each shared tensor once."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in unique if p.requires_grad), sum(p.numel() for p in unique)
