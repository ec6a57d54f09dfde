"""What a fine-tuning run may and may not change of its checkpoint: the model (dropout only), the tokenizer (never)."""

from __future__ import annotations

from typing import Any

from qkv.config import DecoderLMConfig
from qkv.data.tokens import open_data
from qkv.errors import QkvError
from qkv.tokenizers import Tokenizer

# Fine-tuning a pretrained model (--init-from) never inherits the speedrun: AdamW at a small learning rate with a
# short warmup, short runs (each step of a 135M model takes seconds on a CPU), and a short sample. LoRA's adapters
# take a larger rate than full fine-tuning, as in the LoRA paper and PEFT's and litgpt's recipes.
FINETUNE_DEFAULTS: dict[bool, dict[str, Any]] = {
    lora: {"optimizer": "adamw", "lr": 2e-4 if lora else 3e-5, "warmup_steps": 10, "weight_decay": 0.0,
           "beta2": 0.999, "max_steps": 100, "eval_interval": 50, "eval_tokens": 8192, "sample_tokens": 100}
    for lora in (False, True)
}  # fmt: skip

CHANGEABLE = ("dropout", "attention_dropout")  # regularisation while fine-tuning; the weights stay as they are


def finetuned_config(base: DecoderLMConfig, given: dict[str, Any]) -> DecoderLMConfig:
    """The checkpoint's model config with the given dropout; any other model field given must equal the checkpoint's."""
    fields = base.to_dict()
    contradicting = sorted(k for k, v in given.items() if k not in CHANGEABLE and fields.get(k, v) != v)
    unknown = sorted(k for k in given if k not in fields)
    if unknown or contradicting:
        name = (unknown or contradicting)[0]
        has = f"has {name}={fields[name]!r}" if name in fields else "has no such field"
        raise QkvError(f"--model {name}={given[name]!r} contradicts --init-from: the architecture is the checkpoint's "
                       f"(it {has}); drop it (only {' and '.join(CHANGEABLE)} may change)")  # fmt: skip
    try:
        return DecoderLMConfig.from_dict({**fields, **{k: given[k] for k in CHANGEABLE if k in given}})
    except TypeError as e:  # e.g. --model dropout=abc
        raise QkvError(f"invalid model setting in {given}: {e}") from None


def check_data_tokenizer(data_dir: str, tokenizer: Tokenizer, checkpoint: str) -> None:
    """Refuse a data directory prepared with another tokenizer than the checkpoint's, saying how to prepare it."""
    data = open_data(data_dir)
    if data.fingerprint != tokenizer.fingerprint():
        raise QkvError(f"{data_dir} was prepared with another tokenizer ({data.meta['tokenizer']['name']}) than "
                       f"--init-from's; prepare it with `qkv prepare INPUT --out DIR --tokenizer {checkpoint}`, or "
                       "give a text or JSON Lines file to --data")  # fmt: skip
