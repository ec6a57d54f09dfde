"""The checkpoint a fine-tuning run starts from: a GGUF file, a Hugging Face directory, a `qkv convert` directory
or a qkv run (a LoRA run's adapters merged into its own base), with its tokenizer and a reference that pins it.

A LoRA run stores only its adapters, so it needs its base again whenever it is loaded: the reference holds the
base's absolute path and a sha256 of its weights, and a base that has changed since is refused rather than
silently combined with adapters trained on other weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.io.files import file_sha256, load_json
from qkv.io.run_dir import CONFIG_FILE
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer

_WEIGHT_SUFFIX = ".safetensors"
_NOT_WEIGHTS = ("last.safetensors", "last_optim.safetensors")  # a run's resume state, rewritten as it trains
_METADATA = ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template", "gguf_pre_tokenizer")


@dataclass
class Base:
    """A base model (fp32, eval mode), its tokenizer, and {"path", "sha256", "kind", "metadata"} to find and check it
    again (metadata: the checkpoint's special token ids and chat template, for exports)."""

    model: DecoderLM
    tokenizer: Tokenizer
    reference: dict[str, Any]


def _kind(path: Path, role: str = "--init-from") -> str:
    """gguf, qkv (a run or a `qkv convert` directory) or hf; a one-line error (naming the option, `role`) else."""
    from qkv.interop.qkv_dir import is_qkv_dir

    if not path.exists():
        raise QkvError(f"{role} {path}: no such file or directory")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf"
    if path.is_dir() and is_qkv_dir(path):
        return "qkv"
    if path.is_dir() and (path / CONFIG_FILE).is_file() and any(path.glob(f"*{_WEIGHT_SUFFIX}")):
        return "hf"
    raise QkvError(f"{role} {path} is not a checkpoint: give a .gguf file, a Hugging Face directory "
                   "(config.json + safetensors), a `qkv convert` directory or a qkv run")  # fmt: skip


def weights_digest(path: str | Path) -> str:
    """sha256 of a checkpoint's weights: the file itself, or a directory's weight files (names and contents)."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    files = sorted(p for p in path.glob(f"*{_WEIGHT_SUFFIX}") if p.name not in _NOT_WEIGHTS)
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{file_sha256(file)}\n".encode())
    return digest.hexdigest()


def base_reference(path: str | Path, role: str = "--init-from") -> dict[str, Any]:
    """{"path": absolute path, "sha256": weights_digest, "kind": gguf | hf | qkv} of a checkpoint."""
    path = Path(path).expanduser().resolve()
    kind = _kind(path, role)
    return {"path": str(path), "sha256": weights_digest(path), "kind": kind}


def check_reference(reference: dict[str, Any], run: str | Path) -> Path:
    """The base a LoRA run names, if it is still there with the same weights; else a one-line error."""
    path = Path(reference["path"])
    if not path.exists():
        raise QkvError(f"{run} is a LoRA run of {path}, which is gone; put the base back there (sha256 "
                       f"{reference['sha256'][:12]}…) or export the run merged while you have it")  # fmt: skip
    if weights_digest(path) != reference["sha256"]:
        raise QkvError(f"{run} is a LoRA run of {path}, whose weights have changed since (sha256 "
                       f"{weights_digest(path)[:12]}…, the run was trained on {reference['sha256'][:12]}…); "
                       "restore that base, or train the adapters again on this one")  # fmt: skip
    return path


def load_base(path: str | Path, reference: dict[str, Any] | None = None, role: str = "--init-from") -> Base:
    """The decoder-only model and tokenizer at `path` (reference: an earlier one, which the weights must match;
    role: the option that named it, for messages)."""
    from qkv.interop import from_hf, read_checkpoint, tokenizer_from_hf
    from qkv.interop.marian_tokenizer import read_tokenizer

    ref = base_reference(path, role) if reference is None else reference
    where = Path(ref["path"])
    tokenizer: Tokenizer | None
    if ref["kind"] == "qkv":
        from qkv.finetune.runs import load_lm_dir

        model, tokenizer = load_lm_dir(where), read_tokenizer(where)
        if reference is None:  # a fine-tuned run's own checkpoint's ids and chat template, passed on
            ref["metadata"] = dict((load_json(where / CONFIG_FILE).get("base") or {}).get("metadata") or {})
    else:
        ckpt = read_checkpoint(where)  # a GGUF file is read, and dequantised to fp32, once
        model, tokenizer = from_hf(ckpt), tokenizer_from_hf(ckpt)
        if reference is None:  # what exporting the fine-tuned model needs again: the special ids, the chat template
            ref["metadata"] = {k: ckpt.config[k] for k in _METADATA if ckpt.config.get(k) is not None}
    if not isinstance(model, DecoderLM):
        raise QkvError(f"{role} {where} holds a {type(model).__name__}; {role} takes decoder-only language models "
                       "(GPT-2, Llama/SmolLM2, DeepSeek)")  # fmt: skip
    if tokenizer is None:
        raise QkvError(f"{role} {where} has no tokenizer qkv reads (tokenizer.json, vocab.json + merges.txt, "
                       "or GGUF metadata)")  # fmt: skip
    return Base(model.requires_grad_(True), tokenizer, ref)  # a merged LoRA run comes back partly frozen


def is_lora_run(directory: str | Path) -> bool:
    """Whether a directory is a qkv run that stores LoRA adapters (and a reference to its base)."""
    config = Path(directory) / CONFIG_FILE
    if not config.is_file():
        return False
    stored = load_json(config)
    return "base" in stored and (stored.get("training") or {}).get("lora_rank") is not None
