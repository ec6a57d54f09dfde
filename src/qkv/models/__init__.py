"""Models: encoder–decoder Transformer, decoder-only DecoderLM, encoder-only EncoderModel, and their configs."""

from __future__ import annotations

from typing import cast

from torch import nn

from qkv.errors import QkvError
from qkv.models.config import ModelConfig
from qkv.models.decoder_lm import DecoderLM, DecoderLMConfig
from qkv.models.embedding import EmbeddingConfig, Embeddings
from qkv.models.encoder_model import EncoderConfig, EncoderModel, EncoderOutput, MaskedLMHead
from qkv.models.transformer import Transformer, TransformerConfig

QkvConfig = DecoderLMConfig | EncoderConfig | TransformerConfig
QkvModel = DecoderLM | EncoderModel | Transformer
# config.json's model_type ↔ config class; "encoder_decoder" is how `qkv convert` spells "transformer".
MODEL_TYPES: dict[str, type[QkvConfig]] = {
    "decoder_lm": DecoderLMConfig,
    "encoder": EncoderConfig,
    "transformer": TransformerConfig,
    "encoder_decoder": TransformerConfig,
}


def build_model(cfg: QkvConfig) -> QkvModel:
    """The qkv model a config describes (the config's class says which)."""
    if not isinstance(cfg, (DecoderLMConfig, EncoderConfig, TransformerConfig)):
        raise QkvError(f"no qkv model is built from a {type(cfg).__name__}")
    return cfg.build()


def model_type_of(model: nn.Module) -> str:
    """config.json's model_type for a qkv model."""
    for name, cls in (("decoder_lm", DecoderLM), ("encoder", EncoderModel), ("transformer", Transformer)):
        if isinstance(model, cls):
            return name
    cfg = getattr(model, "cfg", None)  # another model a task trains (an SAE): its config names its type
    if isinstance(cfg, ModelConfig) and cfg.model_type:
        return cfg.model_type
    raise QkvError(f"{type(model).__name__} is not a qkv model")


def config_of(model: nn.Module) -> ModelConfig:
    """A qkv model's config (or that of another model a task trains, whose config names its type)."""
    cfg = getattr(model, "cfg", None)
    if isinstance(model, (DecoderLM, EncoderModel, Transformer)) or (isinstance(cfg, ModelConfig) and cfg.model_type):
        return cast(ModelConfig, cfg)
    raise QkvError(f"{type(model).__name__} is not a qkv model")


def config_from_dict(model_type: str, data: dict[str, object]) -> QkvConfig:
    """A model config from config.json's model_type and model entries (flat ones of earlier versions too)."""
    if model_type not in MODEL_TYPES:
        raise QkvError(f"unknown model_type {model_type!r}; expected one of: {', '.join(MODEL_TYPES)}")
    return MODEL_TYPES[model_type].from_dict(dict(data))


__all__ = [
    "MODEL_TYPES",
    "DecoderLM",
    "DecoderLMConfig",
    "EmbeddingConfig",
    "Embeddings",
    "EncoderConfig",
    "EncoderModel",
    "EncoderOutput",
    "MaskedLMHead",
    "ModelConfig",
    "QkvConfig",
    "QkvModel",
    "Transformer",
    "TransformerConfig",
    "build_model",
    "config_from_dict",
    "config_of",
    "model_type_of",
]
