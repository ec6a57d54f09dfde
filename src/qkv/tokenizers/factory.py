"""Create a tokenizer by name, or load whichever kind a directory holds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qkv.errors import QkvError
from qkv.io.files import load_json
from qkv.tokenizers.base import CONFIG_FILE, TOKENIZER_FILE, Tokenizer
from qkv.tokenizers.bpe import ENDOFTEXT, ByteBPETokenizer
from qkv.tokenizers.char import CharTokenizer

TOKENIZER_KINDS: dict[str, type[Tokenizer]] = {"char": CharTokenizer, "bpe": ByteBPETokenizer}
DEFAULT_BPE_VOCAB_SIZE = 1024


def make_tokenizer(
    kind: str, text: str, vocab_size: int | None = None, special_tokens: Sequence[str] = (ENDOFTEXT,)
) -> Tokenizer:
    """Build a tokenizer of `kind` ("char" or "bpe", whose vocabulary starts with `special_tokens`) from a text."""
    if kind == "char":
        # The char vocabulary is whatever characters the text contains; a size cannot be chosen.
        if vocab_size is not None:
            raise QkvError(
                "the char tokenizer's vocabulary is the text's characters; drop the vocab size or use the bpe tokenizer"
            )
        return CharTokenizer.from_text(text)
    if kind == "bpe":
        size = DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size
        return ByteBPETokenizer.train(text, vocab_size=size, special_tokens=special_tokens)
    raise QkvError(f"unknown tokenizer {kind!r}; choose one of: {', '.join(TOKENIZER_KINDS)}")


def load_tokenizer(directory: Path) -> Tokenizer:
    """Load the tokenizer saved in `directory`, whatever its kind."""
    directory = Path(directory)
    if not directory.is_dir():
        raise QkvError(f"tokenizer directory not found: {directory}")
    tokenizer_file = directory / TOKENIZER_FILE
    obj = load_json(tokenizer_file, "tokenizer file")
    # Our own char file names its kind; HF's bpe file cannot, so its kind is in tokenizer_config.json.
    # tokenizer.json is checked first so a stale config left beside a newer char file is ignored.
    if "kind" in obj:
        kind, source = obj["kind"], tokenizer_file
    else:
        source = directory / CONFIG_FILE
        if not source.is_file():
            raise QkvError(
                f"{tokenizer_file} does not say its kind and {source} is missing; "
                "save the tokenizer with qkv to create it"
            )
        kind = load_json(source, "tokenizer file").get("kind")
    cls = TOKENIZER_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise QkvError(f"unknown tokenizer kind {kind!r} in {source}; expected one of: {', '.join(TOKENIZER_KINDS)}")
    return cls.load(directory)
