"""A run directory: what a training run leaves behind, and how to load it back.

    config.json              model, training and tokenizer config (JSON)
    model.safetensors        the best weights (lowest validation loss)
    last.safetensors         the latest weights  ┐
    last_optim.safetensors   optimiser + RNG     ├ everything `--resume` needs
    last_state.json          step, counters, hashes of the two files above ┘
    tokenizer.json           the tokenizer
    metrics.jsonl            one JSON object per evaluation
    loss.png                 train and validation curves
No pickle anywhere: loading a run never executes code from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.config import DecoderLMConfig
from qkv.errors import QkvError
from qkv.generation import stream
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer, load_tokenizer
from qkv.training.checkpoint import PICKLE_SUFFIXES, atomic_write_json, load_json, load_safetensors
from qkv.training.config import TrainConfig

CONFIG_FILE = "config.json"
BEST_FILE = "model.safetensors"
LAST_FILE = "last.safetensors"
METRICS_FILE = "metrics.jsonl"
FORMAT = "qkv-run/1"


def write_run_config(directory: Path, model_cfg: DecoderLMConfig, train_cfg: TrainConfig, tokenizer: Tokenizer) -> None:
    """Write config.json and the tokenizer into a run directory."""
    tokenizer.save(directory)
    atomic_write_json(
        directory / CONFIG_FILE,
        {
            "format": FORMAT,
            "model_type": "decoder_lm",
            "model": model_cfg.to_dict(),
            "training": train_cfg.to_dict(),
            "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size},
        },
    )


def read_run_config(directory: Path) -> dict[str, Any]:
    """config.json of a run directory, with errors that say what is wrong with the directory."""
    directory = Path(directory)
    if not directory.exists():
        raise QkvError(f"run directory {directory} does not exist")
    if not directory.is_dir():
        raise QkvError(f"{directory} is not a directory; pass the run directory that `qkv train` wrote")
    if not (directory / CONFIG_FILE).is_file():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            names = ", ".join(pickles)
            raise QkvError(f"refusing to load pickle file(s) {names} in {directory}: qkv only reads safetensors")
        raise QkvError(f"{directory} is not a qkv run directory ({CONFIG_FILE} missing)")
    config = load_json(directory / CONFIG_FILE)
    if config.get("format") != FORMAT or "model" not in config or "training" not in config:
        raise QkvError(f"{directory / CONFIG_FILE} is not a qkv run config (format {config.get('format')!r})")
    return config


def load_weights(model: torch.nn.Module, state: dict[str, Tensor], source: Path) -> None:
    """Copy `state` into the model, naming any missing, unexpected or mis-shaped tensor."""
    check_weights(model, state, source)
    model.load_state_dict(state)


def check_weights(model: torch.nn.Module, state: dict[str, Tensor], source: Path) -> None:
    """Refuse `state` unless it has exactly the model's tensors with the model's shapes (sharded or not)."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise QkvError(f"{source} lacks tensor(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    if unexpected:
        raise QkvError(f"{source} has unexpected tensor(s) {', '.join(unexpected[:5])}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            want = tuple(expected[name].shape)
            raise QkvError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {want}")


def load_run_weights(model: torch.nn.Module, directory: Path, checkpoint: str) -> None:
    """Copy a run's best (model.safetensors) or last (last.safetensors) weights into the model."""
    if checkpoint not in ("best", "last"):
        raise QkvError(f"checkpoint must be 'best' or 'last', got {checkpoint!r}")
    weights = directory / (BEST_FILE if checkpoint == "best" else LAST_FILE)
    if not weights.is_file():
        raise QkvError(f"{directory} has no {weights.name} yet (training has not reached its first evaluation)")
    load_weights(model, load_safetensors(weights), weights)


@dataclass
class LoadedRun:
    """A trained model with its tokenizer and configs."""

    model: DecoderLM
    tokenizer: Tokenizer
    train_config: TrainConfig
    directory: Path

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> str:
        """The prompt's continuation as text."""
        ids = self.tokenizer.encode_tensor(prompt)[None, :].to(next(self.model.parameters()).device)
        gen = torch.Generator(device=ids.device).manual_seed(seed) if seed is not None else None
        steps = stream(
            self.model, ids, max_new_tokens, temperature, top_k, top_p, eos_id=self.tokenizer.eos_id, generator=gen
        )
        tokens = [int(t) for t in torch.stack(list(steps))[:, 0].tolist()] if max_new_tokens else []
        eos = self.tokenizer.eos_id
        return self.tokenizer.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens)


def load(run_dir: str | Path, checkpoint: str = "best", device: str | torch.device = "cpu") -> LoadedRun:
    """Load a run directory's model (best or last weights) and tokenizer, in eval mode."""
    directory = Path(run_dir)
    config = read_run_config(directory)
    if config.get("model_type", "decoder_lm") != "decoder_lm":
        raise QkvError(f"{directory} holds a {config['model_type']} run, not a language model; try `qkv translate`")
    model = DecoderLM(DecoderLMConfig.from_dict(config["model"]))
    load_run_weights(model, directory, checkpoint)
    tokenizer = load_tokenizer(directory)
    return LoadedRun(model.to(device).eval(), tokenizer, TrainConfig.from_dict(config["training"]), directory)
