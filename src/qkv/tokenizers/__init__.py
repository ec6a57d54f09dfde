"""Tokenizers: character-level and byte-level BPE, behind one interface.

`import qkv.tokenizers` is light (names load on first use): `qkv --help` reads ENDOFTEXT without loading
Hugging Face's tokenizers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ENDOFTEXT": "qkv.tokenizers.base",
    "Tokenizer": "qkv.tokenizers.base",
    "ByteBPETokenizer": "qkv.tokenizers.bpe",
    "CharTokenizer": "qkv.tokenizers.char",
    "TOKENIZER_KINDS": "qkv.tokenizers.factory",
    "load_tokenizer": "qkv.tokenizers.factory",
}

if TYPE_CHECKING:
    from qkv.tokenizers.base import ENDOFTEXT, Tokenizer
    from qkv.tokenizers.bpe import ByteBPETokenizer
    from qkv.tokenizers.char import CharTokenizer
    from qkv.tokenizers.factory import TOKENIZER_KINDS, load_tokenizer


def __getattr__(name: str) -> Any:
    """Import a public name from its module the first time it is used."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qkv.tokenizers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "ENDOFTEXT",
    "TOKENIZER_KINDS",
    "ByteBPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "load_tokenizer",
]
