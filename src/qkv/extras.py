"""Optional packages: each lives in a named extra of qkv and is imported only where it is used."""

from __future__ import annotations

import importlib
from types import ModuleType

from qkv.errors import QkvError


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise a one-line QkvError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise QkvError(f"{feature} needs the {module} package: pip install 'qkv[{extra}]'") from None
