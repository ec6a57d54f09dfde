"""What every model config has: its width and context, the checks that tie its parts together, and the short paths
that settings may use.

A model config is a tree: an embedding (with its positions), one stack per side (each with its blocks: attention,
feed-forward, norm), and the model's own fields (vocabulary, tied weights, …). A setting addresses any leaf by its
dotted path, `decoder.block.attention.n_kv_heads`, or by a shorter one:
- a block's field (attention…, ffn…, norm…, norm_placement, dropout) sets it in every block of every stack;
- a stack's field (n_layers, final_norm, …) sets it in every stack;
- a flat key of the configs before (n_heads, d_ff, positions, …) sets what it stands for today (qkv.io.config_v1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from torch import nn

from qkv.attention import LatentAttentionConfig
from qkv.blocks import BlockConfig, StackConfig
from qkv.config import Config, positive
from qkv.errors import QkvError
from qkv.io import config_v1
from qkv.positional import RotaryPositionsConfig, SinusoidalPositionsConfig

if TYPE_CHECKING:
    from qkv.models.embedding import EmbeddingConfig

M = TypeVar("M", bound="ModelConfig")
_STACK_FIELDS = tuple(f.name for f in dataclasses.fields(StackConfig))
_BLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(BlockConfig))
_FLAT_MEANING = ("dropout", "norm")  # block fields whose flat key meant more (every dropout; the embeddings' norm)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(Config):
    """The model's width and context; each model config adds its embedding, its stacks and its own fields."""

    model_type: ClassVar[str] = ""  # config.json's name for the model
    stacks: ClassVar[tuple[str, ...]] = ()  # the fields that hold a StackConfig: ("decoder",), …

    d_model: int = 512  # the residual stream's width
    max_positions: int | None = 1024  # the longest sequence the positions cover; None until a run's task sets it

    if TYPE_CHECKING:
        embedding: EmbeddingConfig

    def check(self) -> None:
        """The width and context; each stack's blocks against the width; positions that suit the attention."""
        positive(self, "d_model", *(["max_positions"] if self.max_positions is not None else []))
        for name in self.stacks:
            try:
                self.stack(name).check_width(self.d_model)
            except QkvError as e:
                raise QkvError(f"{name}: {e}") from None
        self._check_positions()

    def _check_positions(self) -> None:
        """Sinusoids need an even width; MLA needs rotary positions; rotary ones, even head dims alike in a stack."""
        positions = self.embedding.positions
        if isinstance(positions, SinusoidalPositionsConfig) and self.d_model % 2:
            raise QkvError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        kind = getattr(positions, "kind", "")
        for name in self.stacks:
            attentions = [block.attention for block in self.stack(name).blocks()]
            if any(isinstance(a, LatentAttentionConfig) for a in attentions) and kind != "rotary":
                raise QkvError(f"attention kind mla needs rotary positions (its decoupled RoPE key), got {kind!r}")
            if not isinstance(positions, RotaryPositionsConfig):
                continue
            dims = sorted({a.rotary_dim(self.d_model) for a in attentions})
            if len(dims) > 1:
                raise QkvError(f"{name}: rotary positions need one rotated head dim in every layer, got {dims}")
            if dims[0] % 2:
                raise QkvError(f"rotary positions need an even head dim, got {dims[0]} (d_model / n_heads)")

    @property
    def context_length(self) -> int:
        """max_positions, which a built model always has."""
        if self.max_positions is None:
            raise QkvError("max_positions is not set: give it (a run's task sets it from its block size)")
        return self.max_positions

    def stack(self, name: str) -> StackConfig:
        """One of the model's stacks by name."""
        stack: StackConfig = getattr(self, name)
        return stack

    def blocks(self) -> list[BlockConfig]:
        """Every layer's block, stack after stack."""
        return [block for name in self.stacks for block in self.stack(name).blocks()]

    def depths(self) -> list[int]:
        """Layers per stack: [n_layers] for one stack, [encoder's, decoder's] for an encoder–decoder."""
        return [self.stack(name).n_layers for name in self.stacks]

    def max_heads(self) -> int:
        """The most attention heads any layer has."""
        return max(block.attention.n_heads for block in self.blocks())

    def rotary_dim(self, stack: str | None = None) -> int:
        """The dims rotary positions turn in each head of a stack's attention (the first stack's by default)."""
        return self.stack(stack or self.stacks[0]).blocks()[0].attention.rotary_dim(self.d_model)

    @classmethod
    def of(cls: type[M], **settings: Any) -> M:
        """A config from short settings: the model's own fields, any other setting laid over them (`override`), as in
        DecoderLMConfig.of(vocab_size=100, d_model=64, n_layers=2, n_heads=4)."""
        own = {f.name for f in dataclasses.fields(cls)}
        base = cls(**{k: v for k, v in settings.items() if k in own})
        return base.override({k: v for k, v in settings.items() if k not in own})

    def override(self: M, settings: Mapping[str, Any]) -> M:
        """A new config with settings changed; keys may be full paths, short ones or flat keys (module docstring)."""
        full: dict[str, Any] = {}
        for key, value in settings.items():
            for path, v in self._translated(key, value).items():
                full.update(dict.fromkeys(self.expand(path), v))
        return Config.override(self, full)

    def _translated(self, key: str, value: Any) -> dict[str, Any]:
        """A flat key's setting as its short paths; any other key as it is."""
        names = {f.name for f in dataclasses.fields(self)}
        if "." in key or key in names or key in _STACK_FIELDS or (key in _BLOCK_FIELDS and key not in _FLAT_MEANING):
            return {key: value}
        if not self.stacks:  # no flat keys of layered models: expand() refuses it, naming the model's fields
            return {key: value}
        if key == "embedding_norm":  # a norm over the embeddings like the blocks' norms, or none
            return {"embedding.norm": self.blocks()[0].norm.to_dict() if value else None}
        translated = config_v1.setting(key, value)
        if not translated:
            raise QkvError(f"unknown model setting {key!r}; give a path such as decoder.block.attention.n_heads, or a "
                           f"field of the model ({', '.join(sorted(names))}), of a stack ({', '.join(_STACK_FIELDS)}) "
                           f"or of a block ({', '.join(_BLOCK_FIELDS)})")  # fmt: skip
        if self.embedding.norm is None:  # a flat norm setting reaches the embeddings' norm only where there is one
            translated = {k: v for k, v in translated.items() if not k.startswith("embedding.norm.")}
        return translated

    def expand(self, key: str) -> list[str]:
        """The full paths of a path that may start at a stack's or a block's field."""
        head = key.split(".", 1)[0]
        names = sorted(f.name for f in dataclasses.fields(self))
        if head in names:
            return [key]
        if head in _STACK_FIELDS and self.stacks:  # a model without stacks (an SAE) refuses it, not sets it nowhere
            return [f"{name}.{key}" for name in self.stacks]
        if head in _BLOCK_FIELDS and self.stacks:
            return [f"{name}.{where}.{key}" for name in self.stacks
                    for where in ("block", *(f"layers.{i}" for i in range(len(self.stack(name).layers))))]  # fmt: skip
        raise QkvError(f"unknown model setting {key!r}; the model's fields: {', '.join(names)}")

    @classmethod
    def from_dict(cls: type[M], data: Mapping[str, Any], path: str = "") -> M:
        """Build from a dict; a flat one (written before component configs) is converted first."""
        if config_v1.is_flat(dict(data)):
            data = config_v1.model(cls.model_type, dict(data))
        return super().from_dict(data, path)

    def build(self) -> nn.Module:
        """The model this config describes."""
        raise QkvError(f"{type(self).__name__} builds nothing itself")


def check_vocab(cfg: object, *names: str) -> None:
    """A vocabulary size, where set (a run's task sets it from its tokenizer), must be positive."""
    positive(cfg, *[n for n in names if getattr(cfg, n) is not None])


def require_vocab(cfg: object, *names: str) -> None:
    """Refuse to build a model whose vocabulary size or context is not set yet (a run's task sets them)."""
    for name in (*names, "max_positions"):
        if getattr(cfg, name) is None:
            raise QkvError(f"{name} is not set: give it (a run's task sets it from its tokenizer and block size)")
