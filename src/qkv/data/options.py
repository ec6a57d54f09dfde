"""What `qkv prepare` is asked to do, checked once: the tokenizer to make, the split, the shards, the workers.

Light on purpose (no numpy, no tokenizers): the command's parser reads the defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.data.sources import ReadOptions
from qkv.errors import QkvError
from qkv.tokenizers.base import ENDOFTEXT, check_bpe_vocab

SHARD_TOKENS = 100_000_000  # llm.c's FineWeb shards hold 10⁸ tokens
TRAIN_FRACTION = 0.9  # a single document: the first 90 % of its characters train
GOLDEN = (5**0.5 - 1) / 2  # the validation documents' spacing (Split.is_val)


def train_characters(characters: int) -> int:
    """How many of a single document's characters train (the first TRAIN_FRACTION); the rest validate."""
    return int(TRAIN_FRACTION * characters)


@dataclass(frozen=True)
class TokenizerRecipe:
    """A tokenizer that `prepare` makes from the corpus: char (its characters) or a byte-level BPE."""

    kind: str
    vocab_size: int = 8192  # bpe
    sample_bytes: int = 50_000_000  # bpe: text it learns from, spread over the training documents
    special_tokens: tuple[str, ...] = (ENDOFTEXT,)  # bpe: the vocabulary's first ids

    def __post_init__(self) -> None:
        """Refuse an unknown kind, a sample of nothing and a BPE vocabulary size out of range."""
        if self.kind not in ("char", "bpe"):
            raise QkvError(f"a tokenizer made from the corpus is char or bpe, not {self.kind!r}")
        if self.sample_bytes < 1:
            raise QkvError(f"--sample-bytes must be positive, got {self.sample_bytes}")
        if self.kind == "bpe":
            check_bpe_vocab(self.vocab_size)


@dataclass(frozen=True)
class Split:
    """How validation documents are chosen: a fraction of them spread over the corpus, or the first up to a token
    count."""

    val_fraction: float = 0.01
    val_tokens: int | None = None

    def __post_init__(self) -> None:
        """Refuse fractions outside (0, 1) and counts below 1."""
        if not 0 < self.val_fraction < 1:
            raise QkvError(f"--val-fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")
        if self.val_tokens is not None and self.val_tokens < 1:
            raise QkvError(f"--val-tokens must be positive, got {self.val_tokens}")

    def is_val(self, doc: int, val_tokens_so_far: int) -> bool:
        """Whether document `doc` (0, 1, …) is held out, given the validation tokens before it.

        With a fraction f: document i when the fractional part of i·φ (φ = 0.618…, the golden ratio's) is below f.
        That holds for a share f of any long run of documents, spread evenly, the first one included, and unlike
        every k-th document it has no period that a corpus's own order (k sources taken in turn) could fall into
        step with.
        """
        if self.val_tokens is not None:
            return val_tokens_so_far < self.val_tokens
        return (doc * GOLDEN) % 1.0 < self.val_fraction


@dataclass(frozen=True)
class PrepareOptions:
    """Everything besides the inputs and the tokenizer that decides what `prepare` writes, and how fast."""

    read: ReadOptions = ReadOptions()
    split: Split = Split()
    shard_tokens: int = SHARD_TOKENS
    workers: int | None = None  # processes (None: one per core; 0: none, all in this process)

    def __post_init__(self) -> None:
        """Refuse shard sizes below 1 and negative worker counts."""
        if not 1 <= self.shard_tokens < 2**31:
            raise QkvError(f"--shard-tokens must be between 1 and 2³¹ − 1, got {self.shard_tokens}")
        if self.workers is not None and self.workers < 0:
            raise QkvError(f"--workers must be ≥ 0, got {self.workers}")
