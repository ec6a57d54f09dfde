"""Optimizer and RNG state without pickle: flat tensors for safetensors plus a small JSON-able dict.

PyTorch's own `optimizer.state_dict()` and RNG states are normally saved with torch.save (pickle);
these functions split them so a checkpoint can be read without executing anything.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.optim import Optimizer

from qkv.errors import QkvError

# ---------------------------------------------------------------------------------------------
# Optimizer state
# ---------------------------------------------------------------------------------------------


def to_jsonable(obj: Any, where: str) -> Any:
    """Convert nested Python values to JSON, tagging tuples so they come back as tuples."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [to_jsonable(v, where) for v in obj]}
    if isinstance(obj, list):
        return [to_jsonable(v, where) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v, f"{where}.{k}") for k, v in obj.items()}
    raise QkvError(f"cannot checkpoint {where}: {type(obj).__name__} is neither a tensor nor JSON-able")


def from_jsonable(obj: Any) -> Any:
    """Invert :func:`to_jsonable`."""
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tuple__"}:
            return tuple(from_jsonable(v) for v in obj["__tuple__"])
        return {k: from_jsonable(v) for k, v in obj.items()}
    return obj


def optimizer_state_to_safetensors(optimizer: Optimizer | dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` (or such a dict, e.g. consolidated from shards) into tensors and JSON."""
    sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    state_meta: dict[str, dict[str, Any]] = {}
    for param_id, entries in sd["state"].items():
        plain = state_meta.setdefault(str(param_id), {})
        for name, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"state.{param_id}.{name}"] = value
            else:
                plain[name] = to_jsonable(value, f"optimizer state {param_id}.{name}")
    groups: list[dict[str, Any]] = []
    for i, group in enumerate(sd["param_groups"]):
        plain_group: dict[str, Any] = {}
        for key, value in group.items():
            if isinstance(value, Tensor):  # e.g. lr given as a tensor for capturable/fused optimizers
                tensors[f"param_groups.{i}.{key}"] = value
            else:
                plain_group[key] = to_jsonable(value, f"optimizer param_groups[{i}].{key}")
        groups.append(plain_group)
    return tensors, {"state": state_meta, "param_groups": groups}


def optimizer_state_from_safetensors(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Rebuild a state dict that ``optimizer.load_state_dict`` accepts from the two halves."""
    state: dict[int, dict[str, Any]] = {
        int(pid): from_jsonable(entries) for pid, entries in meta.get("state", {}).items()
    }
    groups: list[dict[str, Any]] = [from_jsonable(g) for g in meta.get("param_groups", [])]
    for key, value in tensors.items():
        kind, index, name = key.split(".", 2)
        if kind == "state":
            state.setdefault(int(index), {})[name] = value
        elif kind == "param_groups" and int(index) < len(groups):
            groups[int(index)][name] = value
        else:
            raise QkvError(f"unexpected optimizer tensor {key!r} in checkpoint")
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------


def rng_state_to_tensors() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Capture the torch (CPU and CUDA), Python ``random`` and numpy global RNG states."""
    tensors: dict[str, Tensor] = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch.cuda.{i}"] = s
    # random.getstate() == (version, 625 ints below 2**32, gauss_next): ints fit int64 exactly.
    version, words, gauss_next = random.getstate()
    tensors["python.random"] = torch.tensor(words, dtype=torch.int64)
    # numpy's legacy state == ("MT19937", uint32[624], pos, has_gauss, cached_gaussian).
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    tensors["numpy.keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    meta = {
        "python_random": {"version": version, "gauss_next": gauss_next},
        "numpy": {
            "algorithm": algorithm,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
    }
    return tensors, meta


def restore_rng_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Restore the states captured by :func:`rng_state_to_tensors`."""
    torch.set_rng_state(tensors["torch.cpu"].to(torch.uint8))
    if torch.cuda.is_available():
        # Resuming on fewer GPUs (or on CPU) is allowed: restore the devices that exist.
        for i in range(torch.cuda.device_count()):
            if f"torch.cuda.{i}" in tensors:
                torch.cuda.set_rng_state(tensors[f"torch.cuda.{i}"].to(torch.uint8), device=i)
    py = meta["python_random"]
    words = tuple(int(w) for w in tensors["python.random"].tolist())
    random.setstate((py["version"], words, py["gauss_next"]))
    npm = meta["numpy"]
    keys = tensors["numpy.keys"].numpy().astype(np.uint32)
    np.random.set_state((npm["algorithm"], keys, npm["pos"], npm["has_gauss"], npm["cached_gaussian"]))


def generator_state(g: torch.Generator) -> Tensor:
    """Return a ``torch.Generator``'s state as a uint8 CPU tensor."""
    return g.get_state()


def set_generator_state(g: torch.Generator, state: Tensor) -> None:
    """Restore a ``torch.Generator`` from :func:`generator_state`'s tensor."""
    g.set_state(state.to(torch.uint8).cpu())
