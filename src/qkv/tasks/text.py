"""What the two tasks on plain text share, the language model and the masked language model: where the tokens
come from (a data directory, or a text file prepared into the cache), a BPE vocabulary's size, the window
length, and the check that a window fits in the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from qkv.config import option
from qkv.data.cache import prepared
from qkv.data.options import TokenizerRecipe
from qkv.data.prepare_state import META_FILE
from qkv.data.tokens import TokenData, TokenSplit, open_data
from qkv.errors import QkvError
from qkv.io.files import load_json
from qkv.io.run_dir import CONFIG_FILE
from qkv.models import ModelConfig
from qkv.tokenizers import Tokenizer
from qkv.training import RunConfig

M = TypeVar("M", bound=ModelConfig)


@dataclass(frozen=True, kw_only=True)
class TextConfig(RunConfig[M]):
    """The shared settings, plus a text, a vocabulary size and a window length."""

    source: str | None = option(None, "a data directory from `qkv prepare`, or a text file (prepared into the cache "
                                "on first use); none: the embedded Shakespeare corpus", fixed=True,
                                flag="data")  # fmt: skip
    vocab_size: int = option(1024, "the byte-level BPE vocabulary's size (bpe tokenizers only)", fixed=True)
    block_size: int | None = option(128, "tokens per window: the context the model trains on (none: the "
                                    "checkpoint's context, at most 1024, when fine-tuning on conversations)",
                                    fixed=True)  # fmt: skip

    def check(self) -> None:
        """The shared checks, then the text's."""
        super().check()
        if self.block_size is not None and self.block_size < 1:
            raise QkvError(f"block-size must be a positive integer, got {self.block_size!r}")
        if self.vocab_size < 1:
            raise QkvError(f"vocab-size must be a positive integer, got {self.vocab_size!r}")

    @property
    def window(self) -> int:
        """The block size, which a task fixes before it reads data (a chat run's comes from its checkpoint)."""
        if self.block_size is None:
            raise QkvError("give --block-size: the context, in tokens, the model trains on")
        return self.block_size

    @property
    def data_dir(self) -> bool:
        """Whether --data names a directory (prepared data) rather than a text file."""
        return self.source is not None and Path(self.source).is_dir()

    def text_name(self) -> str:
        """The text's name in run directories: the file's or directory's, or shakespeare."""
        return "shakespeare" if self.source is None else Path(self.source).stem


def text_data(cfg: TextConfig[Any], run_dir: Path | None, tokenizer: Tokenizer | None, new: Tokenizer | TokenizerRecipe,
              name: str) -> TokenData:  # fmt: skip
    """A run's data: --data DIR as it is, or its text file (None: Shakespeare) prepared into the cache.

    tokenizer: the run's own (resuming, evaluating), which the data must have been made with; for a new run
    (None), `new` makes the file's tokens and `name` names it. run_dir: the run, whose config.json may record
    the data directory it was trained on.
    """
    if cfg.data_dir:
        assert cfg.source is not None
        data = open_data(cfg.source)
    else:  # the directory the run recorded, if it is still there and made with this tokenizer; else the cache's
        recorded, found = _recorded(run_dir), None
        if recorded is not None and tokenizer is not None:
            found = open_data(recorded)
            found = found if found.fingerprint == tokenizer.fingerprint() else None
        data = found or open_data(prepared(cfg.source, tokenizer if tokenizer is not None else new, name))
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


def data_record(cfg: TextConfig[Any], data: TokenData) -> dict[str, Any]:
    """config.json's data entry: the directory the run read and its tokenizer."""
    return {"directory": str(data.directory), "source": cfg.source, "tokenizer": data.meta["tokenizer"]["name"],
            "fingerprint": data.fingerprint}  # fmt: skip


def check_window_fits(block_size: int, train: TokenSplit | Sequence[int]) -> None:
    """A one-line error when no window of block_size + 1 tokens fits in the training split."""
    longest = max(train.sizes.tolist()) if isinstance(train, TokenSplit) else len(train)
    if block_size + 1 > longest:
        where = "any shard of the training data" if isinstance(train, TokenSplit) and len(train.sizes) > 1 else (
            "the training data")  # fmt: skip
        raise QkvError(f"block size {block_size} is larger than {where} ({longest} tokens); use a smaller "
                       "--block-size or more text")  # fmt: skip


def vocabulary(model_vocab: int | None, tokenizer: Tokenizer) -> int:
    """The model's vocabulary size: the tokenizer's; a different one given for the model is refused."""
    if model_vocab is not None and model_vocab != tokenizer.vocab_size:
        raise QkvError(f"--model vocab_size={model_vocab} differs from the tokenizer's {tokenizer.vocab_size}: the "
                       "vocabulary comes from the tokenizer (--vocab-size sets a new BPE's); drop it")  # fmt: skip
    return tokenizer.vocab_size
