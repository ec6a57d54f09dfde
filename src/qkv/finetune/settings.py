"""What a fine-tuning run may and may not change of its checkpoint: the model (its dropouts only), the tokenizer
(never)."""

from __future__ import annotations

from qkv.data.tokens import open_data
from qkv.errors import QkvError
from qkv.models import DecoderLMConfig
from qkv.tokenizers import Tokenizer

_ABSENT = object()


def check_architecture(base: DecoderLMConfig, tuned: DecoderLMConfig) -> None:
    """Refuse a fine-tuning run's model config that differs from its checkpoint's in anything but the dropouts."""
    before, after = dict(base.leaves()), dict(tuned.leaves())
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p, _ABSENT) != after.get(p, _ABSENT)
                     and not p.endswith("dropout"))  # fmt: skip
    if changed:
        path = changed[0]
        has = f"{path}={before[path]!r}" if path in before else f"no {path}"
        asked = f"{path}={after[path]!r}" if path in after else f"no {path}"
        raise QkvError(f"the architecture of --init-from is fixed: it has {has}, the run asks for {asked}; drop that "
                       "setting (only the dropouts may change when fine-tuning)")  # fmt: skip


def check_data_tokenizer(data_dir: str, tokenizer: Tokenizer, checkpoint: str) -> None:
    """Refuse a data directory prepared with another tokenizer than the checkpoint's, saying how to prepare it."""
    data = open_data(data_dir)
    if data.fingerprint != tokenizer.fingerprint():
        raise QkvError(f"{data_dir} was prepared with another tokenizer ({data.meta['tokenizer']['name']}) than "
                       f"--init-from's; prepare it with `qkv prepare INPUT --out DIR --tokenizer {checkpoint}`, or "
                       "give a text or JSON Lines file to --data")  # fmt: skip
