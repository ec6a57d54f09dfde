"""Tokenizers: character-level and byte-level BPE, behind one interface."""

from qkv.tokenizers.base import Tokenizer
from qkv.tokenizers.bpe import ENDOFTEXT, ByteBPETokenizer
from qkv.tokenizers.char import CharTokenizer
from qkv.tokenizers.factory import (
    DEFAULT_BPE_VOCAB_SIZE,
    TOKENIZER_KINDS,
    load_tokenizer,
    make_tokenizer,
)

__all__ = [
    "DEFAULT_BPE_VOCAB_SIZE",
    "ENDOFTEXT",
    "TOKENIZER_KINDS",
    "ByteBPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "make_tokenizer",
]
