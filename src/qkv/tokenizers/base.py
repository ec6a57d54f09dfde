"""The interface every tokenizer implements: text <-> token ids, and saving to a directory."""

from __future__ import annotations

import hashlib
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from qkv.errors import QkvError

if TYPE_CHECKING:  # torch is imported where a tensor is made: `qkv prepare`'s workers never load it
    import torch

# Both kinds save a tokenizer.json (ours for "char", Hugging Face's for "bpe"); the bpe kind also
# writes CONFIG_FILE, because HF's file format has no place for our own fields.
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
ENDOFTEXT = "<|endoftext|>"  # the special token that ends a document (GPT-2's name for it)
MIN_BPE_VOCAB = 257  # a byte-level BPE's 256 bytes and <|endoftext|>
MAX_BPE_VOCAB = 1_000_000


def check_bpe_vocab(vocab_size: int) -> None:
    """Refuse a BPE vocabulary size outside [MIN_BPE_VOCAB, MAX_BPE_VOCAB] in one line, before any learning."""
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise QkvError(f"BPE vocab size must be between {MIN_BPE_VOCAB} (256 bytes + <|endoftext|>) and "
                       f"{MAX_BPE_VOCAB:,}, got {vocab_size}")  # fmt: skip


class Tokenizer(ABC):
    """Maps text to a list of integer token ids and back."""

    kind: ClassVar[str]  # "char" or "bpe": what load_tokenizer dispatches on ("marian": qkv.interop's)

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct token ids (ids are 0 .. vocab_size - 1)."""

    @property
    @abstractmethod
    def eos_id(self) -> int | None:
        """Id of the end-of-text token, or None if the tokenizer has none."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""

    def encode_target(self, text: str) -> list[int]:
        """Token ids of a translation's target-side text: encode's, unless each side has its own model (MarianMT)."""
        return self.encode(text)

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of the token ids `ids`; decode(encode(text)) == text."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write the tokenizer into `directory` (created if needed) so load_tokenizer can read it back."""

    @classmethod
    @abstractmethod
    def load(cls, directory: Path) -> Tokenizer:
        """Read a tokenizer of this kind back from a directory written by save()."""

    def encode_ordinary(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, a special token's string in it taken as plain text (documents of a corpus)."""
        return [self.encode(text) for text in texts]

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of `text` as a 1-D int64 tensor."""
        import torch

        return torch.tensor(self.encode(text), dtype=torch.int64)

    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens, which text decoded for reading leaves out: end-of-text, where there is one."""
        return frozenset() if self.eos_id is None else frozenset({self.eos_id})

    def piece(self, token: int) -> bytes:
        """The bytes token `token` stands for (decode's UTF-8, unless a tokenizer knows its bytes better)."""
        return self.decode([token]).encode("utf-8")

    def token_bytes(self) -> list[int]:
        """UTF-8 bytes of each token id's text, 0 for special tokens (what bits per byte divides by)."""
        # Special tokens (<|endoftext|>) mark where documents end rather than stand for text: 0 bytes, and bits
        # per byte leaves out their loss too (as nanochat does), so the measure depends on the text alone.
        raise QkvError(f"bits per byte needs the bytes of text each token stands for, which a {self.kind} tokenizer "
                       "does not say; compare such models by validation loss, on one tokenizer")  # fmt: skip

    def cuts_like_gpt2(self) -> bool:
        """Whether text cut where GPT-2's pre-tokenizer splits whatever surrounds the cut (between a line break
        and a non-space after a non-space, or before " word") encodes to the tokens of the whole text."""
        return False

    def fingerprint(self) -> str:
        """sha256 of what the tokenizer maps (its saved files): equal fingerprints, equal token ids."""
        digest = hashlib.sha256()
        with tempfile.TemporaryDirectory() as tmp:
            self.save(Path(tmp))
            for path in sorted(Path(tmp).iterdir()):
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()

    def __repr__(self) -> str:
        """Short description, e.g. CharTokenizer(kind='char', vocab_size=65)."""
        return f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size})"
