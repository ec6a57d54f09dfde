"""A text file (or the embedded Shakespeare) given to `qkv train --data FILE`, prepared once into a cache.

Training reads every corpus the same way, from a data directory (qkv.data.tokens). A file given
directly is prepared like `qkv prepare FILE` would, into

    $QKV_CACHE_DIR/data/<name>-<key>/        (QKV_CACHE_DIR defaults to ~/.cache/qkv)

where the key hashes the file's content, the tokenizer (a fingerprint, or the recipe that makes one)
and the split: the same text with the same tokenizer is tokenized once, whichever run asks, and a
changed file is a new key. A lock serialises runs (and the ranks of one run) that ask at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qkv.data.corpus import SHAKESPEARE_SHA256, load_shakespeare
from qkv.data.options import PrepareOptions, TokenizerRecipe
from qkv.data.prepare import prepare
from qkv.data.prepare_state import FORMAT, META_FILE
from qkv.data.tokens import TokenData, open_data
from qkv.errors import QkvError
from qkv.io.files import atomic_write_bytes, file_sha256, load_json
from qkv.tokenizers import Tokenizer

CACHE_ENV = "QKV_CACHE_DIR"


def cache_root() -> Path:
    """$QKV_CACHE_DIR, else $XDG_CACHE_HOME/qkv, else ~/.cache/qkv."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv"


def shakespeare_file() -> Path:
    """The embedded corpus as a plain text file in the cache (written again whenever its sha256 is not the corpus's)."""
    path = cache_root() / "corpora" / f"shakespeare-{SHAKESPEARE_SHA256[:16]}.txt"
    if not path.is_file() or file_sha256(path) != SHAKESPEARE_SHA256:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, load_shakespeare().encode("utf-8"))
    return path


def prepared(source: str | None, tokenizer: Tokenizer | TokenizerRecipe, tokenizer_name: str,
             options: PrepareOptions = PrepareOptions(workers=0)) -> Path:  # fmt: skip
    """The data directory of a text file (None: the embedded Shakespeare) with this tokenizer, prepared if needed.

    In this process by default: training (and a user's script that calls qkv.train) starts no worker processes of
    its own. A large corpus is quicker to `qkv prepare` first, with every core.
    """
    path = shakespeare_file() if source is None else Path(source)
    if not path.is_file():
        raise QkvError(f"text file not found: {path}" if not path.exists() else f"{path} is not a file")
    content = SHAKESPEARE_SHA256 if source is None else file_sha256(path)
    if isinstance(tokenizer, TokenizerRecipe):
        recipe: dict[str, Any] = {"recipe": tokenizer.__dict__}
    else:
        recipe = {"fingerprint": tokenizer.fingerprint()}
    key = json.dumps([FORMAT, content, tokenizer_name, recipe, options.split.__dict__, options.read.__dict__],
                     sort_keys=True)  # fmt: skip
    name = "shakespeare" if source is None else path.stem
    directory = cache_root() / "data" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    with _locked(directory):
        if (directory / META_FILE).is_file() and _same_content(directory, content):
            return directory
        if directory.exists():  # unfinished, or made from a file since rewritten in place: start afresh
            shutil.rmtree(directory)
        prepare([str(path)], directory, tokenizer, tokenizer_name, options, verbose=False)
    return directory


def open_text(source: str | None, tokenizer: Tokenizer | TokenizerRecipe | None = None) -> TokenData:
    """A text file (None: the embedded Shakespeare) prepared and opened: char-level unless a tokenizer is given."""
    tokenizer = TokenizerRecipe("char") if tokenizer is None else tokenizer
    return open_data(prepared(source, tokenizer, tokenizer.kind))


def _same_content(directory: Path, sha256: str) -> bool:
    """Whether a cached preparation was made from text with this sha256."""
    inputs = load_json(directory / META_FILE).get("inputs", [])
    return len(inputs) == 1 and inputs[0].get("sha256") == sha256


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on a cache entry (other processes wait for the one preparing it)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
