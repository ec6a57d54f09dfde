"""A Hugging Face checkpoint in memory, whatever file it was read from (a directory's safetensors, a GGUF file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from qkv.quantization import Blocks


@dataclass
class Checkpoint:
    """A Hugging Face checkpoint in memory: config.json, tensors by HF name, and where it came from."""

    config: dict[str, Any]
    tensors: dict[str, Tensor]
    source: str
    tokenizer: Any = field(default=None, repr=False)  # a `tokenizers.Tokenizer` when the source carries one
    quantized: dict[str, Blocks] = field(default_factory=dict, repr=False)  # GGUF matrices kept as the file has them
