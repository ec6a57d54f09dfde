"""Training text: the embedded Shakespeare corpus, and whole text files read into memory (translation pairs)."""

from __future__ import annotations

import functools
import gzip
import hashlib
from importlib import resources
from pathlib import Path

from qkv.data.sources import as_read
from qkv.errors import QkvError

# sha256 of the uncompressed corpus; see SHAKESPEARE.md for how it is built from a pinned source.
SHAKESPEARE_SHA256 = "1412cb28b622df1847142028209c72346b548e99f52e84290bc0938fd9ff774c"
SHAKESPEARE_RESOURCE = "shakespeare.txt.gz"


@functools.cache
def load_shakespeare() -> str:
    """Return the packaged Shakespeare corpus (1,130,760 bytes, 78 distinct characters), hash-checked."""
    resource = resources.files("qkv.data").joinpath(SHAKESPEARE_RESOURCE)
    try:
        data = gzip.decompress(resource.read_bytes())
    except (OSError, EOFError) as err:  # missing file, or not/truncated gzip
        raise QkvError(
            f"cannot read the packaged corpus {SHAKESPEARE_RESOURCE} ({err}); "
            "reinstall qkv or rebuild it with scripts/build_shakespeare.py"
        ) from err
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise QkvError(
            f"the packaged corpus {SHAKESPEARE_RESOURCE} is corrupted (sha256 {digest}); "
            "reinstall qkv or rebuild it with scripts/build_shakespeare.py"
        )
    return data.decode("utf-8")


def read_text_file(path: str | Path) -> str:
    """Read a UTF-8 training text, normalising line endings to \\n; QkvError if it is unusable."""
    path = Path(path)
    if not path.exists():
        raise QkvError(f"text file not found: {path}")
    if path.is_dir():
        raise QkvError(f"{path} is a directory; give the path of a UTF-8 text file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise QkvError(f"cannot read {path}: {err.strerror or err}") from err
    try:
        # utf-8-sig drops a leading byte-order mark (added by some Windows editors), which would
        # otherwise become an invisible "character" in a char-level vocabulary.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        bad = data[err.start : err.start + 1].hex()
        raise QkvError(
            f"{path} is not valid UTF-8: byte 0x{bad} at byte offset {err.start}; re-save the file as UTF-8"
        ) from err
    text = as_read(text)
    if not text.strip():
        what = "empty" if not text else "whitespace only"
        raise QkvError(f"{path} is {what}; a training text needs at least some characters")
    return text
