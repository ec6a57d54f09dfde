"""qkv: the Transformer, complete — a readable reference implementation that is fast and verified.

`import qkv` is light: each name below is imported from its room on first use, so `import qkv.attention`
(or the `qkv` command's help) loads only what it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv.lazy import lazy_exports

__version__ = "0.1.0"

# Public name → the module that defines it.
_EXPORTS = {
    "scaled_dot_product_attention": "qkv.attention",
    "MultiHeadAttention": "qkv.attention",
    "record_attention": "qkv.attention",
    "BlockConfig": "qkv.blocks",
    "DecoderLMConfig": "qkv.models",
    "EncoderConfig": "qkv.models",
    "ModelConfig": "qkv.models",
    "TransformerConfig": "qkv.models",
    "QkvError": "qkv.errors",
    "Sampling": "qkv.generation",
    "generate": "qkv.generation",
    "quantize_int8": "qkv.quantization",
    "DecoderLM": "qkv.models",
    "EncoderModel": "qkv.models",
    "Transformer": "qkv.models",
    "from_hf": "qkv.interop",
    "save_hf": "qkv.interop",
    "train": "qkv.tasks",
    "load": "qkv.tasks",
    "LMConfig": "qkv.tasks.lm",
    "MLMConfig": "qkv.tasks.mlm",
    "TranslateConfig": "qkv.tasks.translate",
    "CopyConfig": "qkv.tasks.toy",
    "ReverseConfig": "qkv.tasks.toy",
}

if TYPE_CHECKING:
    from qkv.attention import MultiHeadAttention, record_attention, scaled_dot_product_attention
    from qkv.blocks import BlockConfig
    from qkv.errors import QkvError
    from qkv.generation import Sampling, generate
    from qkv.interop import from_hf, save_hf
    from qkv.models import (
        DecoderLM,
        DecoderLMConfig,
        EncoderConfig,
        EncoderModel,
        ModelConfig,
        Transformer,
        TransformerConfig,
    )
    from qkv.quantization import quantize_int8
    from qkv.tasks import load, train
    from qkv.tasks.lm import LMConfig
    from qkv.tasks.mlm import MLMConfig
    from qkv.tasks.toy import CopyConfig, ReverseConfig
    from qkv.tasks.translate import TranslateConfig


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    """The public names, for tab completion."""
    return sorted([*_EXPORTS, "__version__"])


__all__ = [
    "BlockConfig",
    "CopyConfig",
    "DecoderLM",
    "DecoderLMConfig",
    "EncoderConfig",
    "EncoderModel",
    "LMConfig",
    "MLMConfig",
    "ModelConfig",
    "MultiHeadAttention",
    "QkvError",
    "ReverseConfig",
    "Sampling",
    "Transformer",
    "TransformerConfig",
    "TranslateConfig",
    "from_hf",
    "generate",
    "load",
    "quantize_int8",
    "record_attention",
    "save_hf",
    "scaled_dot_product_attention",
    "train",
]
