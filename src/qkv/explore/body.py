"""A request's JSON body, read field by field: each wrong field is a one-line 400 that names it."""

from __future__ import annotations

import math
from typing import Any

from qkv.errors import QkvError

MISSING = object()
MAX_TEXT = 20_000  # characters of typed text
MAX_ENTRY = 1e6  # the largest number a table may hold: its squares and products stay far from overflowing


def _finite(value: Any) -> float | None:
    """A JSON number as a finite float, or None (booleans, strings, NaN, ±inf and 400-digit integers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


class Body:
    """The fields of one JSON request, each read with its type and range checked."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = payload

    def _get(self, name: str, default: Any) -> Any:
        """The raw field, its default, or a 400 when a required field is missing."""
        value = self.payload.get(name, default)
        if value is MISSING:
            raise QkvError(f"the request needs the field {name!r}")
        return value

    def boolean(self, name: str, default: Any = MISSING) -> bool:
        """A true/false field."""
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise QkvError(f"{name!r} must be true or false, got {value!r}")
        return value

    def integer(self, name: str, low: int, high: int, default: Any = MISSING) -> int:
        """A whole number in [low, high]."""
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise QkvError(f"{name!r} must be a whole number between {low} and {high}, got {value!r}")
        return value

    def optional_integer(self, name: str, low: int, high: int) -> int | None:
        """A whole number in [low, high], or null / absent."""
        return None if self.payload.get(name) is None else self.integer(name, low, high)

    def number(self, name: str, low: float, high: float, default: Any = MISSING) -> float:
        """A finite number in [low, high]."""
        number = _finite(self._get(name, default))
        if number is None:
            raise QkvError(f"{name!r} must be a finite number")
        if not low <= number <= high:
            raise QkvError(f"{name!r} must be between {low:g} and {high:g}, got {number:g}")
        return number

    def text(self, name: str, default: Any = MISSING, limit: int = MAX_TEXT) -> str:
        """A string of at most `limit` characters."""
        value = self._get(name, default)
        if not isinstance(value, str):
            raise QkvError(f"{name!r} must be a string, got {type(value).__name__}")
        if len(value) > limit:
            raise QkvError(f"{name!r} is {len(value):,} characters long; the limit is {limit:,}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800"): no tokenizer reads it
            raise QkvError(f"{name!r} holds a lone UTF-16 surrogate, which is not text; send valid Unicode") from None
        return value

    def optional_text(self, name: str, limit: int = MAX_TEXT) -> str | None:
        """A string of at most `limit` characters, or null / absent."""
        return None if self.payload.get(name) is None else self.text(name, limit=limit)

    def strings(self, name: str, limit: int = 64) -> list[str]:
        """A list of non-empty strings (words), stripped of surrounding spaces."""
        value = self._get(name, MISSING)
        if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
            raise QkvError(f"{name!r} must be a list of non-empty strings")
        if len(value) > limit:
            raise QkvError(f"{name!r} holds {len(value)} entries; the limit is {limit}")
        return [w.strip() for w in value]

    def matrix(self, name: str, limit: int = 64) -> list[list[float]]:
        """A non-empty list of equally long lists of finite numbers."""
        value = self._get(name, MISSING)
        rows = value if isinstance(value, list) and 0 < len(value) <= limit else None
        if rows is None or not all(isinstance(r, list) and 0 < len(r) <= limit for r in rows):
            raise QkvError(f"{name!r} must be a non-empty table (a list of lists) of at most {limit} × {limit} numbers")
        if len({len(r) for r in rows}) != 1:
            raise QkvError(f"the rows of {name!r} must all have the same length")
        table = [[_finite(v) for v in r] for r in rows]
        if any(v is None or abs(v) > MAX_ENTRY for r in table for v in r):
            raise QkvError(f"{name!r} must hold numbers between {-MAX_ENTRY:g} and {MAX_ENTRY:g}")
        return [[float(v) for v in r if v is not None] for r in table]

    def ids(self, name: str, limit: int = 100_000) -> list[int] | None:
        """A list of token ids, or null / absent."""
        value = self.payload.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise QkvError(f"{name!r} must be a list of token ids (whole numbers)")
        if len(value) > limit:
            raise QkvError(f"{name!r} holds {len(value):,} ids; the limit is {limit:,}")
        return value
