"""Byte-level BPE: GPT-2's byte alphabet, split regex and decoder, shared by every byte-level tokenizer qkv reads
(GPT-2's own, a Hugging Face directory's vocab.json + merges.txt, a GGUF file's vocabulary), and tiktoken, OpenAI's
BPE engine, which encodes GPT-2's exact vocabulary fast.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import tokenizers as hf

from qkv.tokenizers.base import ENDOFTEXT

# The fingerprint (qkv.tokenizers.bpe.ByteBPETokenizer.fingerprint) of OpenAI's GPT-2 tokenizer (qkv.tokenizers.gpt2).
GPT2_FINGERPRINT = "7f18af8e810a129e3114ee22627e98106f1bc3c790aa24faae9aaaaf19bebeab"
# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, whitespace (as in OpenAI's encoder.py).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_level_bpe(
    vocab: dict[str, int],
    merges: Sequence[tuple[str, str]],
    special_tokens: Sequence[str] = (),
    split_digits: bool = False,
) -> hf.Tokenizer:
    """A GPT-2-style tokenizer: bytes mapped to printable characters, GPT-2's split regex, then BPE.

    split_digits: first split every digit apart (SmolLM2 / StarCoder do, so numbers tokenise digit-wise).
    """
    tok = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=list(merges)))
    # No prefix space: "Hello" at the start of a text is "Hello", not " Hello", as in GPT-2.
    byte_level = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_digits:
        tok.pre_tokenizer = hf.pre_tokenizers.Sequence([hf.pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = hf.decoders.ByteLevel()
    # Special tokens are matched whole before BPE runs, so "<|endoftext|>" in a text is one token.
    tok.add_special_tokens([hf.AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable character → the byte it stands for (the inverse of its bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shift = 0
    for b in range(256):
        if b not in printable:  # control bytes and space: moved to 256 + n so that every byte is printable
            printable.append(b)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def tiktoken_engine(fingerprint: str, vocab: dict[str, int]) -> Any | None:
    """A tiktoken Encoding that encodes exactly as a tokenizer of this fingerprint and vocabulary (its added tokens
    aside), or None (not GPT-2's vocabulary, or no tiktoken).

    tiktoken merges by the rank of the merged bytes rather than by a list of merges; for GPT-2's vocabulary,
    whose ids are its merge order, the two give the same tokens (tests/test_prepare.py checks it on real text).
    """
    if fingerprint != GPT2_FINGERPRINT:
        return None
    try:
        import tiktoken
    except ImportError:
        return None
    decode = byte_decoder()
    ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items() if token != ENDOFTEXT}
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: vocab[ENDOFTEXT]})  # fmt: skip
