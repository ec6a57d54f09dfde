"""Models: encoder–decoder Transformer, decoder-only DecoderLM, encoder-only EncoderModel."""

from qkv.config import BlockConfig, DecoderLMConfig, EncoderConfig, ModelConfig, TransformerConfig
from qkv.models.decoder_lm import DecoderLM
from qkv.models.embedding import Embeddings
from qkv.models.encoder_model import EncoderModel, EncoderOutput
from qkv.models.transformer import Transformer

__all__ = [
    "BlockConfig",
    "DecoderLM",
    "DecoderLMConfig",
    "Embeddings",
    "EncoderConfig",
    "EncoderModel",
    "EncoderOutput",
    "ModelConfig",
    "Transformer",
    "TransformerConfig",
]
