"""How `qkv chat` samples: the flags given, else what the checkpoint recommends, else qkv's default for chat.

A checkpoint may say how to sample from it: transformers' generation_config.json (when it sets do_sample) or a
GGUF file's general.sampling.* keys; interop reads either into the checkpoint's metadata as "sampling". Without
one, chat uses CHAT_SAMPLING, chosen by benchmarks/chat_defaults.py (docs/finetuning.md has its table): small
models answer facts far more often at a low temperature, and the nucleus keeps the rare token that derails them
out of reach.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qkv.generation import Sampling

CHAT_SAMPLING = Sampling(temperature=0.2, top_p=0.9)
_FIELDS = ("temperature", "top_k", "top_p")


def chat_sampling(given: Mapping[str, Any], recommended: Mapping[str, Any] | None) -> tuple[Sampling, str]:
    """The sampling a chat uses, and where it came from: each of temperature, top_k and top_p as given (None: not
    given), else as the checkpoint recommends, else CHAT_SAMPLING's; seed as given."""
    if recommended:
        base, origin = {f: recommended.get(f) for f in _FIELDS}, "the checkpoint's recommendation"
    else:
        base, origin = {f: getattr(CHAT_SAMPLING, f) for f in _FIELDS}, "qkv's default for chat"
    chosen = {f: given[f] if given.get(f) is not None else base[f] for f in _FIELDS}
    if all(given.get(f) is not None for f in _FIELDS):
        origin = "as given"
    elif any(given.get(f) is not None for f in _FIELDS):
        origin = f"as given, the rest {origin}"
    temperature = 1.0 if chosen["temperature"] is None else float(chosen["temperature"])
    return Sampling(temperature, chosen["top_k"], chosen["top_p"], given.get("seed")), origin


def describe(sampling: Sampling) -> str:
    """'temperature 0.2, top-p 0.9' (greedy at temperature 0)."""
    if sampling.temperature == 0:
        return "greedy"
    parts = [f"temperature {sampling.temperature:g}"]
    parts += [f"top-k {sampling.top_k}"] if sampling.top_k is not None else []
    parts += [f"top-p {sampling.top_p:g}"] if sampling.top_p is not None and sampling.top_p < 1 else []
    return ", ".join(parts)
