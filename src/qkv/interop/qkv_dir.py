"""qkv's own model directories, as `qkv convert` writes them: config.json + model.safetensors + tokenizer.

A decoder-only model is written as a qkv run directory (format qkv-run/1, what `qkv train` leaves),
so `qkv generate DIR` and `qkv eval DIR` work on a converted checkpoint; its "training" entry holds
only the tokenizer kind, since the model was not trained by qkv. Encoders and encoder–decoders have
no run format, so they get format qkv-model/1. Tensors carry qkv's own names; load_qkv reads both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.config import DecoderLMConfig, EncoderConfig, TransformerConfig
from qkv.errors import QkvError
from qkv.interop.hf_io import QkvModel, build_model
from qkv.models import DecoderLM, EncoderModel, Transformer
from qkv.tokenizers import Tokenizer
from qkv.training.checkpoint import atomic_save_safetensors, atomic_write_json, load_json, load_safetensors
from qkv.training.run import BEST_FILE, CONFIG_FILE, load_weights
from qkv.training.run import FORMAT as RUN_FORMAT

MODEL_FORMAT = "qkv-model/1"
_CONFIGS: dict[str, type[DecoderLMConfig | EncoderConfig | TransformerConfig]] = {
    "decoder_lm": DecoderLMConfig,
    "encoder": EncoderConfig,
    "encoder_decoder": TransformerConfig,
}


def _model_type(model: QkvModel) -> str:
    """config.json's model_type for a qkv model."""
    if isinstance(model, DecoderLM):
        return "decoder_lm"
    if isinstance(model, EncoderModel):
        return "encoder"
    if isinstance(model, Transformer):
        return "encoder_decoder"
    raise QkvError(f"cannot save a {type(model).__name__} as a qkv model directory")


def save_qkv(model: QkvModel, directory: str | Path, tokenizer: Tokenizer | None = None, source: str = "") -> Path:
    """Write the model (and tokenizer) as a qkv directory: a run directory for decoder-only models."""
    directory = Path(directory)
    model_type = _model_type(model)
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "format": RUN_FORMAT if model_type == "decoder_lm" else MODEL_FORMAT,
        "model_type": model_type,
        "model": model.cfg.to_dict(),
        "converted_from": source,
    }
    if model_type == "decoder_lm":
        config["training"] = {"tokenizer": "bpe"}  # no training happened: TrainConfig's defaults otherwise
    atomic_save_safetensors(directory / BEST_FILE, model.state_dict())
    if tokenizer is not None:
        tokenizer.save(directory)
    atomic_write_json(directory / CONFIG_FILE, config)  # last: a directory with config.json is complete
    return directory


def load_qkv(directory: str | Path) -> QkvModel:
    """A model written by save_qkv (or a qkv training run's best weights), in eval mode."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise QkvError(f"{directory} is not a qkv model directory ({CONFIG_FILE} missing)")
    config = load_json(directory / CONFIG_FILE)
    if config.get("format") not in (RUN_FORMAT, MODEL_FORMAT):
        raise QkvError(f"{directory / CONFIG_FILE} is not a qkv model config (format {config.get('format')!r})")
    cfg_class = _CONFIGS.get(config.get("model_type", "decoder_lm"))
    if cfg_class is None or not isinstance(config.get("model"), dict):
        raise QkvError(f"{directory / CONFIG_FILE} has an unknown model_type {config.get('model_type')!r}")
    model = build_model(cfg_class.from_dict(config["model"]))
    load_weights(model, load_safetensors(directory / BEST_FILE), directory / BEST_FILE)
    return model.eval()
