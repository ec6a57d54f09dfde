"""qkv: the Transformer, complete — a readable reference implementation that is fast and verified."""

from qkv.attention import MultiHeadAttention, scaled_dot_product_attention
from qkv.config import BlockConfig, DecoderLMConfig, EncoderConfig, ModelConfig, TransformerConfig
from qkv.errors import QkvError
from qkv.interop import from_hf
from qkv.models import DecoderLM, EncoderModel, Transformer
from qkv.training import TrainConfig, load, train

__version__ = "0.1.0"

__all__ = [
    "BlockConfig",
    "DecoderLM",
    "DecoderLMConfig",
    "EncoderConfig",
    "EncoderModel",
    "ModelConfig",
    "MultiHeadAttention",
    "QkvError",
    "TrainConfig",
    "Transformer",
    "TransformerConfig",
    "from_hf",
    "load",
    "scaled_dot_product_attention",
    "train",
]
