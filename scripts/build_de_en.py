"""Build src/qkv/data/de_en.tsv.gz from the Debian package trans-de-en 1.9-6 (the Ding dictionary).

    python scripts/build_de_en.py [--deb trans-de-en_1.9-6_all.deb]

Without --deb it runs `apt-get download trans-de-en` in a temporary directory. The .deb is unpacked
with `dpkg-deb -x`; /usr/share/trans/de-en is parsed by qkv.translation.corpus.parse_dictionary.
The gzip is written with mtime 0 and no file name, so the same input gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import tempfile
from pathlib import Path

from qkv.translation.corpus import DE_EN_RESOURCE, pairs_to_tsv, parse_dictionary, tsv_sha256

OUT = Path(__file__).resolve().parents[1] / "src" / "qkv" / "data" / DE_EN_RESOURCE


def main() -> None:
    """Download (if needed), extract, parse, write, print the count and sha256."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deb", type=Path, help="trans-de-en .deb (default: apt-get download trans-de-en)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb
        if deb is None:
            subprocess.run(["apt-get", "download", "trans-de-en"], cwd=tmp, check=True)
            deb = next(Path(tmp).glob("trans-de-en_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "root")], check=True)
        source = Path(tmp) / "root" / "usr" / "share" / "trans" / "de-en"
        with source.open(encoding="utf-8") as f:
            pairs = parse_dictionary(f)
    data = pairs_to_tsv(pairs)
    with (
        open(args.out, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
    ):
        gz.write(data)
    words = sum(len(en.split()) for _, en in pairs) / len(pairs)
    print(f"{len(pairs)} pairs ({words:.1f} English words on average), sha256 {tsv_sha256(data)} -> {args.out}")


if __name__ == "__main__":
    main()
