"""qkv's own model directories, as `qkv convert` writes them: config.json + model.safetensors + tokenizer.

A decoder-only model is written as a run directory of the language-model task (what `qkv train`
leaves), so `qkv generate DIR` and `qkv eval DIR` work on a converted checkpoint; its "training"
entry holds only the tokenizer kind, since the model was not trained by qkv. Encoders and
encoder–decoders are written in format qkv-model/1. Tensors carry qkv's own names; load_qkv reads both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.io.files import atomic_save_safetensors, atomic_write_json, load_json, load_safetensors
from qkv.io.run_dir import BEST_FILE, CONFIG_FILE, FORMAT, FORMATS, load_weights
from qkv.models import MODEL_TYPES, QkvModel, build_model, config_from_dict, model_type_of
from qkv.tokenizers import Tokenizer

MODEL_FORMAT = "qkv-model/1"


def save_qkv(model: QkvModel, directory: str | Path, tokenizer: Tokenizer | None = None, source: str = "") -> Path:
    """Write the model (and tokenizer) as a qkv directory: a language-model run directory for decoder-only models."""
    directory = Path(directory)
    model_type = model_type_of(model)
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "format": FORMAT if model_type == "decoder_lm" else MODEL_FORMAT,
        "model_type": model_type,
        "model": model.cfg.to_dict(),
        "converted_from": source,
    }
    if model_type == "decoder_lm":  # no training happened: the language model's defaults otherwise
        config |= {"task": "lm", "training": {"tokenizer": "bpe"}}
    atomic_save_safetensors(directory / BEST_FILE, model.state_dict())
    if tokenizer is not None:
        tokenizer.save(directory)
    atomic_write_json(directory / CONFIG_FILE, config)  # last: a directory with config.json is complete
    return directory


def is_qkv_dir(path: str | Path) -> bool:
    """Whether `path` is a directory that save_qkv (or a qkv training run) wrote, not a Hugging Face one."""
    config = Path(path) / CONFIG_FILE
    return config.is_file() and load_json(config).get("format") in (*FORMATS, MODEL_FORMAT)


def load_qkv(directory: str | Path) -> QkvModel:
    """A model written by save_qkv (or a qkv training run's best weights), in eval mode."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise QkvError(f"{directory} is not a qkv model directory ({CONFIG_FILE} missing)")
    config = load_json(directory / CONFIG_FILE)
    if config.get("format") not in (*FORMATS, MODEL_FORMAT):
        raise QkvError(f"{directory / CONFIG_FILE} is not a qkv model config (format {config.get('format')!r})")
    model_type = config.get("model_type", "decoder_lm")
    if model_type not in MODEL_TYPES or not isinstance(config.get("model"), dict):
        raise QkvError(f"{directory / CONFIG_FILE} has an unknown model_type {model_type!r}")
    model = build_model(config_from_dict(model_type, config["model"]))
    load_weights(model, load_safetensors(directory / BEST_FILE), directory / BEST_FILE)
    return model.eval()
