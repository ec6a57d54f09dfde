"""Text → tokenizer → train/val token ids, the same way for training and for `qkv eval` (language models)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.data.corpus import load_shakespeare, read_text_file
from qkv.errors import QkvError
from qkv.tokenizers import ENDOFTEXT, Tokenizer, make_tokenizer

TRAIN_FRACTION = 0.9


@dataclass
class TextData:
    """A tokenizer and the token ids of the train and validation splits."""

    tokenizer: Tokenizer
    train_ids: Tensor
    val_ids: Tensor


def load_corpus(path: str | None) -> str:
    """The text of a UTF-8 file, or the embedded Shakespeare corpus when path is None."""
    return load_shakespeare() if path is None else read_text_file(path)


def prepare_text_data(
    path: str | None,
    tokenizer_kind: str = "char",
    vocab_size: int | None = None,
    tokenizer: Tokenizer | None = None,
    special_tokens: Sequence[str] = (ENDOFTEXT,),
) -> TextData:
    """Split the text by characters (first 90 % train, last 10 % val), then tokenize each part.

    A new char vocabulary comes from the whole text (so val never holds an unknown character); a
    new BPE (vocab_size tokens, special_tokens first) is trained on the train split only. Pass
    `tokenizer` to reuse a saved one.
    """
    text = load_corpus(path)
    split = int(TRAIN_FRACTION * len(text))
    train_text, val_text = text[:split], text[split:]
    if tokenizer is None:
        if tokenizer_kind == "char":
            tokenizer = make_tokenizer("char", text)
        else:
            tokenizer = make_tokenizer(tokenizer_kind, train_text, vocab_size, special_tokens)
    train_ids = torch.tensor(tokenizer.encode(train_text), dtype=torch.long)
    val_ids = torch.tensor(tokenizer.encode(val_text), dtype=torch.long)
    if len(val_ids) < 2:
        raise QkvError(f"the text is too short: its last 10 % ({len(val_text)} characters) gives no validation data")
    return TextData(tokenizer, train_ids, val_ids)
