"""Typed model configs, validated at construction: every choice lives here, not in flags.

BlockConfig holds what one layer needs; ModelConfig adds vocabulary, depth and positions;
the three model configs set the defaults of their family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from qkv.errors import QkvError

Activation = Literal["relu", "gelu", "gelu_tanh", "swiglu"]
NormPlacement = Literal["pre", "post"]
Positions = Literal["sinusoidal", "learned", "rotary", "none"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "activation": ("relu", "gelu", "gelu_tanh", "swiglu"),
    "norm": ("layer", "rms", "batch"),
    "norm_placement": ("pre", "post"),
    "positions": ("sinusoidal", "learned", "rotary", "none"),
}

C = TypeVar("C", bound="BlockConfig")


@dataclass(kw_only=True)
class BlockConfig:
    """What an encoder or decoder layer is made of."""

    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads (multi-head); 1 = multi-query; else grouped-query
    d_ff: int | None = None  # None = 4 · d_model (ReLU/GELU) or ⌈8/3 · d_model⌉₈ (SwiGLU)
    dropout: float = 0.1
    bias: bool = True
    activation: Activation = "relu"
    norm: Literal["layer", "rms", "batch"] = "layer"
    norm_placement: NormPlacement = "post"
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        """Validate every field; messages name the field and the rule."""
        for name, choices in _CHOICES.items():
            if hasattr(self, name) and getattr(self, name) not in choices:
                raise QkvError(f"unknown {name} {getattr(self, name)!r}; choose one of: {', '.join(choices)}")
        _positive(self, "d_model", "n_heads")
        if self.d_model % self.n_heads != 0:
            raise QkvError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads != 0):
            raise QkvError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.d_ff is None:
            # SwiGLU has three matrices instead of two: 8/3 · d_model (rounded up to a multiple of 8)
            # keeps its parameters and FLOPs equal to a 4 · d_model ReLU/GELU layer's.
            self.d_ff = 4 * self.d_model if self.activation != "swiglu" else -(-8 * self.d_model // 24) * 8
        _positive(self, "d_ff")
        if not 0.0 <= self.dropout < 1.0:
            raise QkvError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0:
            raise QkvError(f"norm_eps must be positive, got {self.norm_eps}")

    @property
    def d_head(self) -> int:
        """d_k = d_v = d_model / n_heads."""
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        """Build from a dict (e.g. config.json), refusing unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise QkvError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
        return cls(**data)


@dataclass(kw_only=True)
class ModelConfig(BlockConfig):
    """A stack of layers over a vocabulary."""

    vocab_size: int
    n_layers: int = 6
    positions: Positions = "learned"
    max_positions: int = 1024
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply token embeddings by √d_model, as the paper does
    final_norm: bool | None = None  # None = a final norm for pre-norm stacks only

    def __post_init__(self) -> None:
        """Validate the model-level fields, then the block's."""
        super().__post_init__()
        _positive(self, "vocab_size", "n_layers", "max_positions")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise QkvError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.positions == "rotary" and self.d_head % 2:
            raise QkvError(f"rotary positions need an even head dim, got d_model/n_heads={self.d_head}")
        if self.final_norm is None:
            self.final_norm = self.norm_placement == "pre"


@dataclass(kw_only=True)
class DecoderLMConfig(ModelConfig):
    """GPT-style decoder-only language model: causal self-attention, pre-norm, GELU."""

    norm_placement: NormPlacement = "pre"
    activation: Activation = "gelu"
    dropout: float = 0.0


@dataclass(kw_only=True)
class EncoderConfig(ModelConfig):
    """BERT-style encoder: bidirectional self-attention, post-norm, token types, pooled output."""

    activation: Activation = "gelu"
    type_vocab_size: int = 2  # 0 = no token-type (segment) embeddings
    embedding_norm: bool = True  # BERT normalises the summed embeddings
    pooler: bool = True  # tanh(W · h_[CLS]) as the sequence representation

    def __post_init__(self) -> None:
        """Validate, then check the encoder-only fields."""
        super().__post_init__()
        if self.type_vocab_size < 0:
            raise QkvError(f"type_vocab_size must be ≥ 0, got {self.type_vocab_size}")


@dataclass(kw_only=True)
class TransformerConfig(BlockConfig):
    """The encoder–decoder Transformer of "Attention Is All You Need"."""

    src_vocab_size: int
    tgt_vocab_size: int
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    positions: Positions = "sinusoidal"
    max_positions: int = 1024
    rope_base: float = 10000.0
    share_embeddings: bool = False  # one embedding matrix for source and target (shared vocabulary)
    tie_embeddings: bool = True  # output projection = target embedding matrix (transposed)
    scale_embeddings: bool = True  # the paper multiplies embeddings by √d_model
    final_norm: bool | None = None
    pad_id: int = 0

    def __post_init__(self) -> None:
        """Validate, including that shared embeddings need one vocabulary."""
        super().__post_init__()
        _positive(self, "src_vocab_size", "tgt_vocab_size", "n_encoder_layers", "n_decoder_layers")
        _positive(self, "max_positions")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise QkvError(
                f"share_embeddings needs one vocabulary, got src_vocab_size={self.src_vocab_size} "
                f"and tgt_vocab_size={self.tgt_vocab_size}"
            )
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise QkvError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.final_norm is None:
            self.final_norm = self.norm_placement == "pre"

    @classmethod
    def paper_base(cls, vocab_size: int) -> TransformerConfig:
        """The paper's base model: N=6, d_model=512, d_ff=2048, h=8, dropout 0.1, shared vocabulary."""
        return cls(
            src_vocab_size=vocab_size,
            tgt_vocab_size=vocab_size,
            d_model=512,
            d_ff=2048,
            n_heads=8,
            dropout=0.1,
            share_embeddings=True,
            tie_embeddings=True,
        )

    @classmethod
    def paper_big(cls, vocab_size: int) -> TransformerConfig:
        """The paper's big model: N=6, d_model=1024, d_ff=4096, h=16, dropout 0.3."""
        return cls(
            src_vocab_size=vocab_size,
            tgt_vocab_size=vocab_size,
            d_model=1024,
            d_ff=4096,
            n_heads=16,
            dropout=0.3,
            share_embeddings=True,
            tie_embeddings=True,
        )

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The embedding-side view (positions, scale) used to build one side's Embeddings."""
        return ModelConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(BlockConfig)},
            vocab_size=vocab_size,
            positions=self.positions,
            max_positions=self.max_positions,
            rope_base=self.rope_base,
            scale_embeddings=self.scale_embeddings,
        )


def _positive(cfg: object, *names: str) -> None:
    """Raise a QkvError for the first named integer field that is not ≥ 1."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise QkvError(f"{name} must be a positive integer, got {value!r}")
