"""What the two tasks on plain text share, the language model and the masked language model: where the tokens
come from (a data directory, or a text file prepared into the cache), a BPE vocabulary's size, the window
length, and the check that a window fits in the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.data.cache import prepared
from qkv.data.options import TokenizerRecipe
from qkv.data.prepare_state import META_FILE
from qkv.data.tokens import TokenData, TokenSplit, open_data
from qkv.errors import QkvError
from qkv.io.files import load_json
from qkv.io.run_dir import CONFIG_FILE
from qkv.tokenizers import Tokenizer
from qkv.training import RunConfig, option
from qkv.training.config import absolute, positive_int


@dataclass(kw_only=True)
class TextConfig(RunConfig):
    """The shared settings, plus a text, a vocabulary size and a window length."""

    data: str | None = option(None, "a data directory from `qkv prepare`, or a text file (prepared into the cache "
                              "on first use); none: the embedded Shakespeare corpus", fixed=True)  # fmt: skip
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

    def refuse_tokenizer_options(self) -> None:
        """A new run on a data directory takes its tokenizer: --tokenizer and --vocab-size would be ignored."""
        fixed_by_data = sorted(self.given & {"tokenizer", "vocab_size"})
        if self.data_dir and fixed_by_data:
            flags = " and ".join(f"--{name.replace('_', '-')}" for name in fixed_by_data)
            raise QkvError(f"{self.data} is a data directory: its tokenizer is the one it was prepared with; "
                           f"drop {flags}")

    @property
    def data_dir(self) -> bool:
        """Whether --data names a directory (prepared data) rather than a text file."""
        return self.data is not None and Path(self.data).is_dir()

    def text_name(self) -> str:
        """The text's name in run directories: the file's or directory's, or shakespeare."""
        return "shakespeare" if self.data is None else Path(self.data).stem


def text_data(cfg: TextConfig, run_dir: Path | None, tokenizer: Tokenizer | None, new: Tokenizer | TokenizerRecipe,
              name: str) -> TokenData:  # fmt: skip
    """A run's data: --data DIR as it is, or its text file (None: Shakespeare) prepared into the cache.

    tokenizer: the run's own (resuming, evaluating), which the data must have been made with; for a new run
    (None), `new` makes the file's tokens and `name` names it. run_dir: the run, whose config.json may record
    the data directory it was trained on.
    """
    if cfg.data_dir:
        assert cfg.data is not None
        if tokenizer is None:
            cfg.refuse_tokenizer_options()
        data = open_data(cfg.data)
    else:  # the directory the run recorded, if it is still there and made with this tokenizer; else the cache's
        recorded, found = _recorded(run_dir), None
        if recorded is not None and tokenizer is not None:
            found = open_data(recorded)
            found = found if found.fingerprint == tokenizer.fingerprint() else None
        data = found or open_data(prepared(cfg.data, tokenizer if tokenizer is not None else new, name))
    if tokenizer is not None and data.fingerprint != tokenizer.fingerprint():
        raise QkvError(f"{data.directory} was prepared with another tokenizer ({data.meta['tokenizer']['name']}) than "
                       f"the run's; give the data the run was trained on, or prepare it with `qkv prepare --tokenizer "
                       f"{run_dir}`")  # fmt: skip
    return data


def _recorded(run_dir: Path | None) -> Path | None:
    """The data directory a run's config.json records, if it is still there, finished."""
    if run_dir is None or not (run_dir / CONFIG_FILE).is_file():
        return None
    entry = load_json(run_dir / CONFIG_FILE).get("data") or {}
    directory = entry.get("directory")
    return Path(directory) if isinstance(directory, str) and (Path(directory) / META_FILE).is_file() else None


def data_record(cfg: TextConfig, data: TokenData) -> dict[str, Any]:
    """config.json's data entry: the directory the run read and its tokenizer."""
    return {"directory": str(data.directory), "source": cfg.data, "tokenizer": data.meta["tokenizer"]["name"],
            "fingerprint": data.fingerprint}  # fmt: skip


def check_window_fits(block_size: int, train: TokenSplit | Sequence[int]) -> None:
    """A one-line error when no window of block_size + 1 tokens fits in the training split."""
    longest = max(train.sizes.tolist()) if isinstance(train, TokenSplit) else len(train)
    if block_size + 1 > longest:
        where = "any shard of the training data" if isinstance(train, TokenSplit) and len(train.sizes) > 1 else (
            "the training data")  # fmt: skip
        raise QkvError(f"block size {block_size} is larger than {where} ({longest} tokens); use a smaller "
                       "--block-size or more text")  # fmt: skip
