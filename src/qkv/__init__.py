"""qkv: the Transformer, complete — a readable reference implementation that is fast and verified.

`import qkv` is light: each name below is imported from its room on first use, so `import qkv.attention`
(or the `qkv` command's help) loads only what it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv.lazy import lazy_exports

__version__ = "0.1.0"

# The public names, each with the module that defines it: the one list that __all__ and the lazy loader read.
_EXPORTS = {
    # attention
    "scaled_dot_product_attention": "qkv.attention",
    "MultiHeadAttention": "qkv.attention",
    "MultiHeadAttentionConfig": "qkv.attention",
    "LatentAttention": "qkv.attention",
    "LatentAttentionConfig": "qkv.attention",
    "AttentionConfig": "qkv.attention",
    "record_attention": "qkv.attention",
    "causal_mask": "qkv.attention",
    "sliding_window_mask": "qkv.attention",
    "padding_mask_from_ids": "qkv.attention",
    "padding_mask_from_lengths": "qkv.attention",
    "combine_masks": "qkv.attention",
    # positional
    "SinusoidalPositionalEncoding": "qkv.positional",
    "LearnedPositionalEmbedding": "qkv.positional",
    "RotaryEmbedding": "qkv.positional",
    "apply_rotary": "qkv.positional",
    "PositionsConfig": "qkv.positional",
    # norms
    "LayerNorm": "qkv.norms",
    "RMSNorm": "qkv.norms",
    "NormConfig": "qkv.norms",
    # blocks
    "BlockConfig": "qkv.blocks",
    "FeedForwardConfig": "qkv.blocks",
    "MoEConfig": "qkv.blocks",
    "StackConfig": "qkv.blocks",
    # models
    "ModelConfig": "qkv.models",
    "EmbeddingConfig": "qkv.models",
    "DecoderLMConfig": "qkv.models",
    "EncoderConfig": "qkv.models",
    "TransformerConfig": "qkv.models",
    "DecoderLM": "qkv.models",
    "EncoderModel": "qkv.models",
    "Transformer": "qkv.models",
    # generation
    "Sampling": "qkv.generation",
    "generate": "qkv.generation",
    # quantization
    "quantize_int8": "qkv.quantization",
    # interop
    "from_hf": "qkv.interop",
    "save_hf": "qkv.interop",
    # tasks
    "train": "qkv.tasks",
    "load": "qkv.tasks",
    "recipe": "qkv.tasks",
    # errors
    "QkvError": "qkv.errors",
}
# Names that left the top level: they still work, with a DeprecationWarning naming their new home.
_MOVED = {
    "LMConfig": "qkv.tasks.lm",
    "MLMConfig": "qkv.tasks.mlm",
    "TranslateConfig": "qkv.tasks.translate",
    "CopyConfig": "qkv.tasks.toy",
    "ReverseConfig": "qkv.tasks.toy",
}

if TYPE_CHECKING:  # the same names, for type checkers (tests/test_api.py holds the two lists equal)
    from qkv.attention import (
        AttentionConfig,
        LatentAttention,
        LatentAttentionConfig,
        MultiHeadAttention,
        MultiHeadAttentionConfig,
        causal_mask,
        combine_masks,
        padding_mask_from_ids,
        padding_mask_from_lengths,
        record_attention,
        scaled_dot_product_attention,
        sliding_window_mask,
    )
    from qkv.blocks import BlockConfig, FeedForwardConfig, MoEConfig, StackConfig
    from qkv.errors import QkvError
    from qkv.generation import Sampling, generate
    from qkv.interop import from_hf, save_hf
    from qkv.models import (
        DecoderLM,
        DecoderLMConfig,
        EmbeddingConfig,
        EncoderConfig,
        EncoderModel,
        ModelConfig,
        Transformer,
        TransformerConfig,
    )
    from qkv.norms import LayerNorm, NormConfig, RMSNorm
    from qkv.positional import (
        LearnedPositionalEmbedding,
        PositionsConfig,
        RotaryEmbedding,
        SinusoidalPositionalEncoding,
        apply_rotary,
    )
    from qkv.quantization import quantize_int8
    from qkv.tasks import load, recipe, train

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS, _MOVED)


def __dir__() -> list[str]:
    """The public names, for tab completion."""
    return [*__all__, "__version__"]
