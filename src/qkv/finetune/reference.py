"""How a fine-tuning run names the checkpoint it started from: the checkpoint's kind, and a reference that pins it
(its absolute path and a sha256 of its weights); and whether a qkv run stores LoRA adapters, and which.

A LoRA run stores only its adapters, so it needs its base again whenever it is loaded: a base that has changed since
is refused rather than silently combined with adapters trained on other weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.io.files import PICKLE_SUFFIXES, file_sha256, load_json
from qkv.io.run_dir import CONFIG_FILE
from qkv.lora import LoRAConfig

_WEIGHT_SUFFIX = ".safetensors"
_NOT_WEIGHTS = ("last.safetensors", "last_optim.safetensors")  # a run's resume state, rewritten as it trains


def checkpoint_kind(path: Path, role: str = "--init-from") -> str:
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
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES) if path.is_dir() else []
    if pickles:
        raise QkvError(f"refusing to load pickle file(s) {', '.join(pickles)} in {path}: qkv only reads safetensors")
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
    kind = checkpoint_kind(path, role)
    return {"path": str(path), "sha256": weights_digest(path), "kind": kind}


def check_reference(reference: dict[str, Any], run: str | Path, what: str = "a LoRA run",
                    redo: str = "train the adapters again on this one") -> Path:  # fmt: skip
    """The model a run was trained on (a LoRA run's base, an SAE's model), if it is still there with the same
    weights; else a one-line error (what: the run's kind; redo: what to do about changed weights)."""
    path = Path(reference["path"])
    if not path.exists():
        raise QkvError(f"{run} is {what} of {path}, which is gone; put the model back there (sha256 "
                       f"{reference['sha256'][:12]}…)")  # fmt: skip
    if weights_digest(path) != reference["sha256"]:
        raise QkvError(f"{run} is {what} of {path}, whose weights have changed since (sha256 "
                       f"{weights_digest(path)[:12]}…, the run was trained on {reference['sha256'][:12]}…); "
                       f"restore that model, or {redo}")  # fmt: skip
    return path


def lora_of(training: dict[str, Any]) -> LoRAConfig | None:
    """The LoRA settings of a run config's "training" entry (the flat lora_* settings of earlier versions too)."""
    if "lora" in training:
        return LoRAConfig.from_dict(training["lora"], "lora") if training["lora"] is not None else None
    if training.get("lora_rank") is None:
        return None
    targets = tuple(t.strip() for t in str(training["lora_targets"]).split(",") if t.strip())
    return LoRAConfig(rank=training["lora_rank"], alpha=training.get("lora_alpha"), dropout=training["lora_dropout"],
                      targets=targets)  # fmt: skip


def is_lora_run(directory: str | Path) -> bool:
    """Whether a directory is a qkv run that stores LoRA adapters (and a reference to its base)."""
    config = Path(directory) / CONFIG_FILE
    if not config.is_file():
        return False
    stored = load_json(config)
    return "base" in stored and lora_of(stored.get("training") or {}) is not None
