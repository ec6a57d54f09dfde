"""Character-level tokenizer: one token per distinct character of the training text."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qkv.errors import QkvError
from qkv.io.files import atomic_write_json, load_json
from qkv.tokenizers.base import TOKENIZER_FILE, Tokenizer

if TYPE_CHECKING:
    import torch

_MAX_SHOWN = 10  # unknown characters listed in an error message


class CharTokenizer(Tokenizer):
    """Token id i is the i-th character of a sorted alphabet, as in nanoGPT's shakespeare_char."""

    kind = "char"

    def __init__(self, chars: Sequence[str]) -> None:
        """Build from the vocabulary: distinct single characters, in id order."""
        chars = list(chars)
        if not chars:
            raise QkvError("a character vocabulary needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise QkvError(f"a character vocabulary holds single characters, got {bad[0]!r}")
        if len(set(chars)) != len(chars):
            dupes = sorted({c for c in chars if chars.count(c) > 1})
            raise QkvError(f"character vocabulary has duplicates: {', '.join(map(repr, dupes))}")
        self._chars = chars
        # Lookup table indexed by Unicode code point, so encoding is one vectorised numpy gather
        # instead of a Python dict lookup per character. The extra last slot holds -1 ("unknown")
        # and catches every code point above the largest one in the vocabulary.
        points = np.array([ord(c) for c in chars], dtype=np.int64)
        self._table = np.full(int(points.max()) + 2, -1, dtype=np.int64)
        self._table[points] = np.arange(len(chars), dtype=np.int64)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary = the sorted distinct characters of `text`."""
        if not text:
            raise QkvError("cannot build a character vocabulary from empty text")
        return cls(sorted(set(text)))

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        """Read a tokenizer written by save()."""
        path = Path(directory) / TOKENIZER_FILE
        obj = load_json(path, "tokenizer file")
        chars = obj.get("chars")
        if obj.get("kind") != cls.kind or not isinstance(chars, list):
            raise QkvError(f"{path} is not a char tokenizer file (expected keys 'kind': 'char' and 'chars')")
        return cls(chars)

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self._chars)

    @property
    def eos_id(self) -> int | None:
        """None: the character vocabulary has no end-of-text token."""
        return None

    @property
    def chars(self) -> list[str]:
        """The vocabulary, in id order (a copy)."""
        return list(self._chars)

    def _encode_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as an int64 numpy array."""
        # UTF-32 gives exactly one 4-byte unit per character, i.e. the code points, without a loop.
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int64)
        ids = self._table[np.minimum(points, len(self._table) - 1)]
        if ids.size and ids.min() < 0:
            unknown = [chr(p) for p in np.unique(points[ids < 0])]
            shown = ", ".join(map(repr, unknown[:_MAX_SHOWN]))
            if len(unknown) > _MAX_SHOWN:
                shown += ", ..."
            raise QkvError(
                f"{len(unknown)} character(s) not in the vocabulary: {shown}; the char vocabulary "
                "comes from the training text, so remove them or retrain on text that contains them"
            )
        return ids

    def encode(self, text: str) -> list[int]:
        """One id per character; QkvError naming any characters outside the vocabulary."""
        return self._encode_array(text).tolist()

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids as a 1-D int64 tensor, skipping the intermediate Python list."""
        import torch

        return torch.from_numpy(self._encode_array(text))

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids as an int64 numpy array (what `qkv prepare` writes into shards)."""
        return self._encode_array(text)

    def token_bytes(self) -> list[int]:
        """UTF-8 bytes of each character (1 to 4); a character vocabulary has no special tokens."""
        return [len(c.encode("utf-8", "surrogatepass")) for c in self._chars]

    def cuts_like_gpt2(self) -> bool:
        """True: one token per character, whatever surrounds it."""
        return True

    def fingerprint(self) -> str:
        """sha256 of the vocabulary, in id order."""
        return hashlib.sha256(json.dumps(self._chars, ensure_ascii=False).encode("utf-8")).hexdigest()

    def decode(self, ids: Sequence[int]) -> str:
        """Concatenate the characters of `ids`."""
        ids = [int(i) for i in ids]  # also accepts tensors and numpy arrays
        size = len(self._chars)
        if ids and (min(ids) < 0 or max(ids) >= size):
            bad = next(i for i in ids if not 0 <= i < size)
            raise QkvError(f"token id {bad} is out of range for a vocabulary of {size} characters")
        chars = self._chars
        return "".join([chars[i] for i in ids])

    def save(self, directory: Path) -> None:
        """Write tokenizer.json: {"kind": "char", "chars": [...]}."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(directory) / TOKENIZER_FILE, {"kind": self.kind, "chars": self._chars})
