"""Load whichever kind of tokenizer a directory holds."""

from __future__ import annotations

from pathlib import Path

from qkv.errors import QkvError
from qkv.io.files import load_json
from qkv.tokenizers.base import CONFIG_FILE, TOKENIZER_FILE, Tokenizer
from qkv.tokenizers.bpe import ByteBPETokenizer
from qkv.tokenizers.char import CharTokenizer

TOKENIZER_KINDS: dict[str, type[Tokenizer]] = {"char": CharTokenizer, "bpe": ByteBPETokenizer}


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
