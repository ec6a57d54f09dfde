"""The checkpoint a fine-tuning run starts from: a GGUF file, a Hugging Face directory, a `qkv convert` directory
or a qkv run (a LoRA run's adapters merged into its own base), with its tokenizer and a reference that pins it
(qkv.finetune.reference); and LoRA runs loaded back: their base, hash-checked, then their adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.finetune.reference import base_reference, check_reference, checkpoint_kind, is_lora_run, lora_of
from qkv.io.files import load_json, load_safetensors
from qkv.io.run_dir import BEST_FILE, CHECKPOINTS, CONFIG_FILE, LAST_FILE, check_weights, read_run_config
from qkv.lora import LoRAConfig, add_lora, merge_lora
from qkv.models import DecoderLM, DecoderLMConfig, QkvConfig, QkvModel, config_from_dict
from qkv.tokenizers import Tokenizer

_METADATA = ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template", "gguf_pre_tokenizer", "sampling")


@dataclass
class Base:
    """A base model (fp32, eval mode), its tokenizer, and {"path", "sha256", "kind", "metadata"} to find and check it
    again (metadata: the checkpoint's special token ids and chat template, for exports)."""

    model: DecoderLM
    tokenizer: Tokenizer
    reference: dict[str, Any]


def base_config(path: str | Path, role: str = "--init-from") -> DecoderLMConfig:
    """The model config of the checkpoint at `path`, read without its weights (a decoder-only one, or an error)."""
    path = Path(path).expanduser().resolve()
    if checkpoint_kind(path, role) == "qkv":
        stored = load_json(path / CONFIG_FILE)
        cfg: QkvConfig = config_from_dict(stored.get("model_type", "decoder_lm"), stored["model"])
    else:
        from qkv.interop import config_of

        cfg = config_of(path)
    return _decoder_only(cfg, path, role)


def _decoder_only(cfg: QkvConfig, where: Path, role: str) -> DecoderLMConfig:
    """The config of a decoder-only language model, or a one-line error naming what the checkpoint holds."""
    if not isinstance(cfg, DecoderLMConfig):
        raise QkvError(f"{role} {where} holds a {type(cfg).__name__.removesuffix('Config')}; {role} takes "
                       "decoder-only language models (GPT-2, Llama/SmolLM2, DeepSeek)")  # fmt: skip
    return cfg


def load_base(path: str | Path, reference: dict[str, Any] | None = None, role: str = "--init-from",
              native: bool = False) -> Base:  # fmt: skip
    """The decoder-only model and tokenizer at `path` (reference: an earlier one, which the weights must match;
    role: the option that named it, for messages; native: a GGUF's quantised matrices kept so, for inference)."""
    from qkv.interop import from_hf, read_checkpoint, tokenizer_from_hf
    from qkv.interop.marian_tokenizer import read_tokenizer

    ref = base_reference(path, role) if reference is None else reference
    where = Path(ref["path"])
    tokenizer: Tokenizer | None
    if ref["kind"] == "qkv":
        model, tokenizer = load_lm_dir(where), read_tokenizer(where)
        if reference is None:  # a fine-tuned run's own checkpoint's ids and chat template, passed on
            ref["metadata"] = dict((load_json(where / CONFIG_FILE).get("base") or {}).get("metadata") or {})
    else:
        ckpt = read_checkpoint(where, native)  # a GGUF file is read (and dequantised to fp32 unless native) once
        model, tokenizer = from_hf(ckpt), tokenizer_from_hf(ckpt)
        if reference is None:  # what exporting the fine-tuned model needs again: the special ids, the chat template
            ref["metadata"] = {k: ckpt.config[k] for k in _METADATA if ckpt.config.get(k) is not None}
    _decoder_only(model.cfg, where, role)
    if tokenizer is None:
        raise QkvError(f"{role} {where} has no tokenizer qkv reads (tokenizer.json, vocab.json + merges.txt, "
                       "or GGUF metadata)")  # fmt: skip
    assert isinstance(model, DecoderLM)
    return Base(model.requires_grad_(True), tokenizer, ref)  # a merged LoRA run comes back partly frozen


def complete_state(model: nn.Module, saved: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """A run's saved tensors (its adapters) with the model's frozen ones around them, checked as a whole."""
    state = {**model.state_dict(), **saved}
    check_weights(model, state, source)
    return state


def load_lora_run(directory: str | Path, stored: dict[str, Any] | None = None, checkpoint: str = "best",
                  merge: bool = True) -> DecoderLM:  # fmt: skip
    """A LoRA run's model: its base (refused if its weights changed), its adapters, merged unless merge=False."""
    directory = Path(directory)
    stored = read_run_config(directory) if stored is None else stored
    lora = lora_of(stored["training"])
    if lora is None or "base" not in stored:
        raise QkvError(f"{directory} is not a LoRA run (its config.json has no LoRA settings and base)")
    check_reference(stored["base"], directory)
    model = load_base(stored["base"]["path"], stored["base"]).model
    cfg = config_from_dict(stored["model_type"], stored["model"])
    if cfg != model.cfg:  # e.g. dropout given for fine-tuning: the same weights in the run's own model
        rebuilt = DecoderLM(cfg)  # type: ignore[arg-type]
        rebuilt.load_state_dict(model.state_dict())
        model = rebuilt
    return _with_adapters(model, lora, directory, checkpoint, merge)


def _with_adapters(model: DecoderLM, lora: LoRAConfig, directory: Path, checkpoint: str, merge: bool) -> DecoderLM:
    """The model with a run's trained adapters (best or last), merged into its weights unless merge=False."""
    add_lora(model, lora)
    if checkpoint not in CHECKPOINTS:
        raise QkvError(f"checkpoint must be 'best' or 'last', got {checkpoint!r}")
    weights = directory / (BEST_FILE if checkpoint == "best" else LAST_FILE)
    if not weights.is_file():
        raise QkvError(f"{directory} has no {weights.name} yet (training has not reached its first evaluation)")
    model.load_state_dict(complete_state(model, load_safetensors(weights), weights))
    return (merge_lora(model) if merge else model).eval()  # type: ignore[return-value]


def load_lm_dir(directory: str | Path) -> QkvModel:
    """A qkv directory's model: a `qkv convert` directory or a run, a LoRA run merged onto its base."""
    from qkv.interop.qkv_dir import load_qkv

    return load_lora_run(directory) if is_lora_run(directory) else load_qkv(directory)
