"""The Annotated Transformer's sanity check: learn to copy (or reverse) random digit sequences.

It runs the same batching, training step and decoding as translation, so a bug in any of them
shows up here in seconds: a correct model reaches 100 % exact match on held-out sequences.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from qkv.config import TransformerConfig
from qkv.models import Transformer
from qkv.training.schedule import LRSchedule
from qkv.translation.batching import Specials, make_batch, source_tensor
from qkv.translation.decoding import greedy_decode, one_cpu_thread
from qkv.translation.step import train_step

Task = Literal["copy", "reverse"]
SPECIALS = Specials(pad=0, bos=1, eos=2)
FIRST_DIGIT = 3  # digit d is token FIRST_DIGIT + d


@dataclass
class ToyResult:
    """How a toy run went."""

    task: str
    steps: int
    train_seconds: float
    exact_match: float  # fraction of held-out sequences reproduced exactly
    model: Transformer


def toy_model(n_symbols: int = 10, d_model: int = 64, n_layers: int = 2) -> Transformer:
    """A small encoder–decoder over <pad> <s> </s> + the digits (pre-norm, no dropout: the task is noise-free)."""
    vocab = FIRST_DIGIT + n_symbols
    cfg = TransformerConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, n_heads=4, d_ff=4 * d_model, dropout=0.0,
        n_encoder_layers=n_layers, n_decoder_layers=n_layers, norm_placement="pre", share_embeddings=True,
        max_positions=64, pad_id=SPECIALS.pad,
    )  # fmt: skip
    return Transformer(cfg)


def random_sequences(n: int, length: int, n_symbols: int, gen: torch.Generator) -> list[list[int]]:
    """n random digit sequences as token ids."""
    return (torch.randint(0, n_symbols, (n, length), generator=gen) + FIRST_DIGIT).tolist()


def target_of(seq: list[int], task: Task) -> list[int]:
    """The expected output for a source sequence."""
    return seq[::-1] if task == "reverse" else list(seq)


def exact_match(model: Transformer, task: Task, sources: list[list[int]]) -> float:
    """Fraction of sources whose greedy output equals the expected target exactly."""
    model.eval()
    outputs = greedy_decode(model, source_tensor(sources, SPECIALS), SPECIALS, max_len=len(sources[0]) + 2)
    return sum(out == target_of(s, task) for out, s in zip(outputs, sources, strict=True)) / len(sources)


@one_cpu_thread()  # tiny matrices: two threads only wait on each other (see decoding.one_cpu_thread)
def train_toy(
    task: Task, steps: int = 600, batch_size: int = 64, length: int = 10, n_symbols: int = 10,
    max_time: float = 60.0, seed: int = 0, n_test: int = 1000,
) -> ToyResult:  # fmt: skip
    """Train a toy model on `task` for `steps` steps (or max_time seconds), then score held-out sequences."""
    torch.manual_seed(seed)
    model = toy_model(n_symbols)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = LRSchedule(3e-3, min(100, steps), steps, 3e-4, "cosine")
    gen = torch.Generator().manual_seed(seed)
    start, step = time.monotonic(), 0
    model.train()
    while step < steps and time.monotonic() - start < max_time:
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        sources = random_sequences(batch_size, length, n_symbols, gen)
        batch = make_batch(sources, [target_of(s, task) for s in sources], SPECIALS)
        train_step(model, optimizer, batch, smoothing=0.0, grad_clip=1.0)
        step += 1
    seconds = time.monotonic() - start
    test = random_sequences(n_test, length, n_symbols, torch.Generator().manual_seed(seed + 1))  # held out
    return ToyResult(task, step, seconds, exact_match(model, task, test), model)
