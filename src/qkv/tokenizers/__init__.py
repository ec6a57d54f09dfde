"""Tokenizers: character-level and byte-level BPE, behind one interface."""

from qkv.tokenizers.base import Tokenizer
from qkv.tokenizers.bpe import ENDOFTEXT, ByteBPETokenizer
from qkv.tokenizers.char import CharTokenizer
from qkv.tokenizers.factory import TOKENIZER_KINDS, load_tokenizer

__all__ = [
    "ENDOFTEXT",
    "TOKENIZER_KINDS",
    "ByteBPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "load_tokenizer",
]
