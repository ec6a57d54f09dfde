"""Bits per byte of a language model on a text: a measure that does not depend on how the text was cut into tokens.

The summed next-token cross-entropy over the predicted tokens, in bits, divided by the UTF-8 bytes of those same
tokens (qkv.training.evaluate), read by the protocol of every validation loss qkv reports: consecutive windows,
every position predicted once. A character model, a BPE and SmolLM2 scored on one text give comparable numbers.

The text is a UTF-8 file (tokenized whole, as one document), the validation split of a `qkv prepare` directory
made with the model's tokenizer, or by default the embedded Shakespeare's validation split: the characters a
default `qkv train` holds out, so a run's last val_bpb and this agree where the block sizes do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qkv.data.batches import Tokens
from qkv.data.corpus import load_shakespeare
from qkv.data.options import train_characters
from qkv.data.tokens import open_data
from qkv.errors import QkvError
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer
from qkv.training.evaluate import eval_rows, evaluate_sums

if TYPE_CHECKING:
    from qkv.evals.models import EvalModel

DEFAULT_SOURCE = "the embedded Shakespeare's validation split"
# `qkv eval --bpb` reads windows of the model's context, at most this long: GPT-2's context, and the evaluation's
# cost (attention grows with the square of the window) stays within reach of a CPU for long-context checkpoints.
MAX_BLOCK = 1024


@dataclass(frozen=True)
class BpbResult:
    """Bits per byte of a model on a text, and the sums behind it."""

    bpb: float  # bits per byte of the predicted tokens' text
    loss: float  # mean next-token cross-entropy, nats per predicted token (special tokens included, as val loss)
    tokens: int  # tokens predicted (every token but the first)
    bytes: int  # UTF-8 bytes of the predicted tokens' text
    source: str  # what was scored
    block_size: int  # tokens per window: a longer context predicts better, so the figure depends on it

    def line(self) -> str:
        """How `qkv eval --bpb` prints it: 'bits per byte 2.797 (loss 1.9389 nats per token, …) on …'."""
        return (f"bits per byte {self.bpb:.3f} (loss {self.loss:.4f} nats per token; {self.tokens:,} tokens, "
                f"{self.bytes:,} bytes, windows of {self.block_size:,} tokens) on {self.source}")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The result as the results JSON stores it."""
        return asdict(self)


def default_text() -> str:
    """The embedded Shakespeare's validation split as text: what a default `qkv train` holds out."""
    text = load_shakespeare()
    return text[train_characters(len(text)) :]


def text_bpb(model: DecoderLM, tokenizer: Tokenizer, source: Path | None, block_size: int, batch_size: int = 32,
             device: torch.device | str = "cpu", max_tokens: int | None = None, *, checkpoint: str = "MODEL",
             ) -> BpbResult:  # fmt: skip
    """Bits per byte of `model` on a UTF-8 text file, a `qkv prepare` directory's validation split or (None) the
    default text, in windows of block_size tokens (max_tokens of them spread over the text, if set).

    checkpoint: how the model is named in the hint of a directory prepared with another tokenizer.
    """
    sizes = torch.tensor(tokenizer.token_bytes(), dtype=torch.int64)  # a tokenizer that cannot say fails first
    tokens: Tokens
    if source is None:
        tokens, what = _encode(tokenizer, default_text()), DEFAULT_SOURCE
    elif Path(source).is_dir():
        data = open_data(source)
        if data.fingerprint != tokenizer.fingerprint():
            raise QkvError(f"{source} was prepared with another tokenizer ({data.meta['tokenizer']['name']}) than "
                           f"the model's; prepare it with `qkv prepare INPUT --out DIR --tokenizer {checkpoint}` or "
                           "pass a text file")  # fmt: skip
        tokens, what = data.split("val"), f"{source}'s validation split"
    else:
        tokens, what = _encode(tokenizer, read_text(Path(source))), str(source)
    rows = eval_rows(batch_size, block_size, model.embed.vocab_size)
    training = model.training
    model.eval()  # dropout off: the score of the model, not of one draw of its dropout masks
    try:
        sums = evaluate_sums(model, tokens, block_size, rows, device, max_tokens, token_bytes=sizes)
    finally:
        model.train(training)
    return BpbResult(sums.bits_per_byte(), sums.mean, sums.targets, sums.text_bytes, what, block_size)


def bpb_of(lm: EvalModel, source: str | None, batch_size: int = 32) -> BpbResult:
    """`qkv eval MODEL --bpb [SOURCE]`: text_bpb in windows of the model's context (at most MAX_BLOCK tokens)."""
    device = next(lm.model.parameters()).device
    block_size = min(lm.model.cfg.context_length, MAX_BLOCK)
    return text_bpb(lm.model, lm.tokenizer, Path(source) if source else None, block_size, batch_size, device)


def read_text(path: Path) -> str:
    """A UTF-8 text file's content as it is (a byte-order mark dropped); a one-line QkvError if it cannot be scored."""
    if not path.exists():
        raise QkvError(f"{path} not found; give a UTF-8 text file or a `qkv prepare` data directory")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise QkvError(f"cannot read {path}: {err.strerror or err}") from err
    if not data:
        raise QkvError(f"{path} is empty; bits per byte needs some text to score")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise QkvError(f"{path} is not UTF-8 text: byte 0x{data[err.start]:02x} at byte offset {err.start}; "
                       "re-save it as UTF-8") from err  # fmt: skip


def _encode(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """The text's tokens as one document: a special token's string in it is text, like the rest."""
    return torch.tensor(tokenizer.encode_ordinary([text])[0], dtype=torch.int64)
