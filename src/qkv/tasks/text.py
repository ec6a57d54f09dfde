"""What the two tasks on plain text share, the language model and the masked language model: the text,
a BPE vocabulary's size, the window length, and the check that a window fits in the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from qkv.errors import QkvError
from qkv.training import RunConfig, option
from qkv.training.config import absolute, positive_int


@dataclass(kw_only=True)
class TextConfig(RunConfig):
    """The shared settings, plus a text, a vocabulary size and a window length."""

    data: str | None = option(None, "a UTF-8 text file (none: the embedded Shakespeare corpus)", fixed=True)
    vocab_size: int = option(1024, "the byte-level BPE vocabulary's size", fixed=True)
    block_size: int = option(128, "tokens per window", fixed=True)

    def __post_init__(self) -> None:
        """The shared checks, then the text's."""
        super().__post_init__()
        positive_int(self, "block_size")
        positive_int(self, "vocab_size")
        if "vocab_size" in self.model:
            raise QkvError("the model's vocab_size comes from the tokenizer; use --vocab-size (bpe) instead")
        self.data = absolute(self.data)

    def text_name(self) -> str:
        """The text's name in run directories: the file's, or shakespeare."""
        return "shakespeare" if self.data is None else Path(self.data).stem


def check_window_fits(block_size: int, train_ids: Tensor) -> None:
    """A one-line error when the training split is shorter than one window."""
    if block_size + 1 > len(train_ids):
        raise QkvError(f"block size {block_size} is larger than the training data ({len(train_ids)} tokens); "
                       "use a smaller --block-size or more text")  # fmt: skip
