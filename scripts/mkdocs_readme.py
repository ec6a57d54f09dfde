"""MkDocs hook: the site's home page is the README, with its links pointed inside the site.

The README links to docs/PAGE.md, docs/images/… and notebooks/…; on the site those are PAGE.md, images/…
and notebooks/… (docs/notebooks links to ../notebooks). One text, so the front page and the home page
cannot drift apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    """Add index.md, generated from README.md."""
    readme = (Path(config["config_file_path"]).parent / "README.md").read_text(encoding="utf-8")
    home = readme.replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=home))
    return files
