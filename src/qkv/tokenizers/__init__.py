"""Tokenizers: character-level and byte-level BPE, behind one interface.

`import qkv.tokenizers` is light (names load on first use): `qkv --help` reads ENDOFTEXT without loading
Hugging Face's tokenizers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv.lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "ENDOFTEXT",
    "TOKENIZER_KINDS",
    "ByteBPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "load_tokenizer",
]
