"""Packages whose public names load on first use, so that importing one (`import qkv`, `qkv --help`) stays light."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str],
                 moved: Mapping[str, str] | None = None) -> Callable[[str], Any]:  # fmt: skip
    """A package's module-level __getattr__: each name of `exports` (name → module) is imported on first use; a
    name of `moved` (name → its new module) still loads, with a DeprecationWarning that says where it went."""
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        if name in moved:
            warnings.warn(f"{package}.{name} has moved: import it from {moved[name]} (the top-level name goes in the "
                          "next release)", DeprecationWarning, stacklevel=2)  # fmt: skip
            return getattr(importlib.import_module(moved[name]), name)
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__
