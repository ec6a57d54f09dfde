"""Typed model configs, validated at construction: every choice lives here, not in flags.

BlockConfig holds what one layer needs; ModelConfig adds vocabulary, depth and positions;
the three model configs set the defaults of their family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from qkv.errors import QkvError

Activation = Literal["relu", "gelu", "gelu_tanh", "swiglu", "silu"]
NormPlacement = Literal["pre", "post"]
Positions = Literal["sinusoidal", "learned", "rotary", "none"]
SinusoidLayout = Literal["interleaved", "halves"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "activation": ("relu", "gelu", "gelu_tanh", "swiglu", "silu"),
    "attention": ("mha", "mla"),
    "norm": ("layer", "rms", "batch"),
    "norm_placement": ("pre", "post"),
    "positions": ("sinusoidal", "learned", "rotary", "none"),
    "sinusoid_layout": ("interleaved", "halves"),
}

C = TypeVar("C", bound="BlockConfig")


@dataclass(kw_only=True)
class BlockConfig:
    """What an encoder or decoder layer is made of."""

    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads (multi-head); 1 = multi-query; else grouped-query
    # None = 4 · d_model (ReLU/GELU/SiLU) or ⌈8/3 · d_model⌉₈ (SwiGLU); 0 = no feed-forward (attention-only layers)
    d_ff: int | None = None
    dropout: float = 0.1
    # On the attention weights. None = `dropout` (Tensor2Tensor, HF); the paper drops only sub-layer outputs and
    # embeddings, and 0 lets PyTorch's fused attention kernel run while training on a CPU.
    attention_dropout: float | None = None
    bias: bool = True
    activation: Activation = "relu"
    norm: Literal["layer", "rms", "batch"] = "layer"
    norm_placement: NormPlacement = "post"
    norm_eps: float = 1e-5
    # Multi-head latent attention (DeepSeek-V2/V3, qkv.attention.latent) for self-attention; the next fields apply to
    # "mla" only, which needs rotary positions. Cross-attention is always multi-head attention.
    attention: Literal["mha", "mla"] = "mha"
    kv_lora_rank: int | None = None  # d_c, the cached latent's width; None = 4 · d_head (DeepSeek-V2's ratio)
    q_lora_rank: int | None = None  # the query latent's width; None = no query compression
    qk_nope_head_dim: int | None = None  # per-head q/k dims without positions; None = d_head
    qk_rope_head_dim: int | None = None  # per-head decoupled RoPE dims (even); None = d_head / 2
    v_head_dim: int | None = None  # None = d_head
    mla_absorb: bool = False  # attend against the cached latent, W_UK and W_UV folded into query and output
    # Mixture-of-experts feed-forward (DeepSeek-V3, qkv.blocks.moe); moe_experts = 0 keeps every FFN dense.
    moe_experts: int = 0  # routed experts per MoE layer
    moe_top_k: int = 2  # routed experts each token uses
    moe_shared_experts: int = 1  # experts every token uses
    moe_d_ff: int | None = None  # each expert's hidden width; None = d_ff
    moe_groups: int = 1  # expert groups for group-limited routing
    moe_topk_groups: int = 1  # groups a token may route into
    moe_norm_topk: bool = True  # renormalise the top-k gates to sum to 1
    moe_scale: float = 1.0  # multiplier on the routed experts' gates (DeepSeek's routed_scaling_factor)
    moe_first_dense: int = 0  # the first layers keep a dense FFN (DeepSeek's first_k_dense_replace)

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
        if not isinstance(self.d_ff, int) or isinstance(self.d_ff, bool) or self.d_ff < 0:
            raise QkvError(f"d_ff must be an integer ≥ 0 (0 = attention-only layers), got {self.d_ff!r}")
        if self.attention_dropout == self.dropout:
            self.attention_dropout = None  # one spelling per config, so that equal configs compare equal
        for name, p in (("dropout", self.dropout), ("attention_dropout", self.attn_dropout)):
            if not 0.0 <= p < 1.0:
                raise QkvError(f"{name} must be in [0, 1), got {p}")
        if self.norm_eps <= 0:
            raise QkvError(f"norm_eps must be positive, got {self.norm_eps}")
        _check_latent_attention(self)
        _check_moe(self)

    @property
    def attn_dropout(self) -> float:
        """Dropout on attention weights: attention_dropout, or dropout where that is None."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

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
    # Where the sinusoids' cosines go: interleaved with the sines (the paper), or in the second half (Marian, fairseq).
    sinusoid_layout: SinusoidLayout = "interleaved"
    max_positions: int = 1024
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply token embeddings by √d_model, as the paper does
    final_norm: bool | None = None  # None = a final norm for pre-norm stacks only
    embedding_norm: bool = False  # a norm over the summed embeddings (BERT, BART)
    position_offset: int = 0  # learned-position rows skipped before position 0 (BART reserves 2)

    def __post_init__(self) -> None:
        """Validate the model-level fields, then the block's."""
        super().__post_init__()
        _positive(self, "vocab_size", "n_layers", "max_positions")
        _check_position_offset(self)
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise QkvError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        _check_sinusoid_layout(self)
        if self.positions == "rotary" and self.d_head % 2:
            raise QkvError(f"rotary positions need an even head dim, got d_model/n_heads={self.d_head}")
        _check_latent_positions(self)
        if self.final_norm is None:
            self.final_norm = self.norm_placement == "pre"

    @property
    def rotary_dim(self) -> int:
        """The dims per head that RoPE rotates: the whole head, or MLA's decoupled qk_rope_head_dim part."""
        return self.qk_rope_head_dim if self.attention == "mla" and self.qk_rope_head_dim else self.d_head


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
    mlm_head: bool = False  # BERT's masked-LM head: transform (dense, activation, norm), then the tied output layer

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
    sinusoid_layout: SinusoidLayout = "interleaved"  # "halves": [sin | cos], as Marian (OPUS-MT) lays them out
    max_positions: int = 1024
    rope_base: float = 10000.0
    share_embeddings: bool = False  # one embedding matrix for source and target (shared vocabulary)
    tie_embeddings: bool = True  # output projection = target embedding matrix (transposed)
    scale_embeddings: bool = True  # the paper multiplies embeddings by √d_model
    final_norm: bool | None = None
    pad_id: int = 0
    embedding_norm: bool = False  # a norm over each side's summed embeddings (BART's layernorm_embedding)
    position_offset: int = 0  # learned-position rows skipped before position 0 (BART reserves 2)
    output_bias: bool = False  # a bias on the output projection (BART's final_logits_bias)

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
        _check_sinusoid_layout(self)
        _check_position_offset(self)
        _check_latent_positions(self)
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
            sinusoid_layout=self.sinusoid_layout,
            max_positions=self.max_positions,
            rope_base=self.rope_base,
            scale_embeddings=self.scale_embeddings,
            embedding_norm=self.embedding_norm,
            position_offset=self.position_offset,
        )


def _check_position_offset(cfg: ModelConfig | TransformerConfig) -> None:
    """A position offset only shifts a learned table, and cannot be negative."""
    if cfg.position_offset < 0 or (cfg.position_offset and cfg.positions != "learned"):
        raise QkvError(f"position_offset={cfg.position_offset} must be ≥ 0 and needs learned positions")


def _check_sinusoid_layout(cfg: ModelConfig | TransformerConfig) -> None:
    """A layout other than the paper's only means something for sinusoidal positions (one spelling per config)."""
    if cfg.sinusoid_layout != "interleaved" and cfg.positions != "sinusoidal":
        raise QkvError(f"sinusoid_layout={cfg.sinusoid_layout!r} needs positions='sinusoidal', got {cfg.positions!r}")


def _check_latent_positions(cfg: ModelConfig | TransformerConfig) -> None:
    """MLA carries positions in its decoupled RoPE key, so it needs rotary positions."""
    if cfg.attention == "mla" and cfg.positions != "rotary":
        raise QkvError(f"attention='mla' needs positions='rotary' (its decoupled RoPE key), got {cfg.positions!r}")


def _check_latent_attention(cfg: BlockConfig) -> None:
    """MLA's fields: only with attention='mla'; fill the None defaults."""
    fields = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_absorb")
    if cfg.attention != "mla":
        stray = [name for name in fields if getattr(cfg, name) not in (None, False)]
        if stray:
            raise QkvError(f"{', '.join(stray)} only apply to attention='mla' (got attention={cfg.attention!r})")
        return
    if cfg.n_kv_heads is not None:
        raise QkvError("n_kv_heads does not apply to attention='mla': every head reads the one shared latent")
    defaults = {"kv_lora_rank": 4 * cfg.d_head, "qk_nope_head_dim": cfg.d_head,
                "qk_rope_head_dim": max(2, cfg.d_head // 4 * 2), "v_head_dim": cfg.d_head}  # fmt: skip
    for name, value in defaults.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    _positive(cfg, *defaults)
    if cfg.q_lora_rank is not None:
        _positive(cfg, "q_lora_rank")
    if cfg.qk_rope_head_dim is not None and cfg.qk_rope_head_dim % 2:
        raise QkvError(f"qk_rope_head_dim must be even (RoPE rotates pairs of dims), got {cfg.qk_rope_head_dim}")


def _check_moe(cfg: BlockConfig) -> None:
    """The mixture-of-experts fields, when moe_experts > 0; fill moe_d_ff."""
    if not isinstance(cfg.moe_experts, int) or cfg.moe_experts < 0:
        raise QkvError(f"moe_experts must be an integer ≥ 0 (0 = dense FFNs), got {cfg.moe_experts!r}")
    if cfg.moe_experts == 0:
        return
    if cfg.d_ff == 0:
        raise QkvError("moe_experts needs feed-forward layers: d_ff=0 (attention-only) has none")
    if cfg.moe_d_ff is None:
        cfg.moe_d_ff = cfg.d_ff
    _positive(cfg, "moe_top_k", "moe_groups", "moe_topk_groups", "moe_d_ff")
    for name in ("moe_shared_experts", "moe_first_dense"):
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 0:
            raise QkvError(f"{name} must be an integer ≥ 0, got {getattr(cfg, name)!r}")
    per_group = cfg.moe_experts // cfg.moe_groups
    if cfg.moe_experts % cfg.moe_groups or (cfg.moe_groups > 1 and per_group < 2):
        raise QkvError(f"moe_groups={cfg.moe_groups} must divide moe_experts={cfg.moe_experts} into groups of ≥ 2")
    if cfg.moe_topk_groups > cfg.moe_groups:
        raise QkvError(f"moe_topk_groups={cfg.moe_topk_groups} exceeds moe_groups={cfg.moe_groups}")
    if cfg.moe_top_k > cfg.moe_topk_groups * per_group:
        reachable = cfg.moe_topk_groups * per_group
        raise QkvError(f"moe_top_k={cfg.moe_top_k} exceeds the {reachable} experts a token may reach")
    if cfg.moe_scale <= 0:
        raise QkvError(f"moe_scale must be positive, got {cfg.moe_scale}")


def _positive(cfg: object, *names: str) -> None:
    """Raise a QkvError for the first named integer field that is not ≥ 1."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise QkvError(f"{name} must be a positive integer, got {value!r}")
