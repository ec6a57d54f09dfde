"""Helpers shared by several test files (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from qkv.attention import record_attention
from qkv.cli import main


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Train in-process on one thread, like the OMP_NUM_THREADS=1 subprocesses, so floats match bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """qkv.cli.main(argv) in-process → (exit code, stdout, stderr); argparse's SystemExit counts as a return."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def with_weights(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(*args, **kwargs) inside record_attention: (its output, the attention weights of its one attention call)."""
    with record_attention() as recorder:
        out = fn(*args, **kwargs)
    (weights,) = recorder.weights_of()
    return out, weights


@dataclass
class Maps:
    """Recorded attention weights per layer, by kind."""

    self_attn: list[torch.Tensor]
    cross_attn: list[torch.Tensor]


def with_maps(model: torch.nn.Module, *args: Any, call: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """(call or model)(*args, **kwargs) inside record_attention(model): (its output, Maps of every layer)."""
    with record_attention(model) as recorder:
        out = (call or model)(*args, **kwargs)
    return out, Maps(recorder.weights_of("*self_attn"), recorder.weights_of("*cross_attn"))


# --- tiny runs of every task, for the tests of the one training loop ------------------------------------

TASK_NAMES = ("lm", "translate", "mlm", "copy", "reverse")
_TINY_MODEL = {"d_model": 32, "n_heads": 2, "dropout": 0.0}


def tiny_settings(task: str, data: dict[str, Path]) -> dict[str, Any]:
    """Settings of a run of `task` that takes seconds: one-layer models on small data, dropout 0, CPU."""
    common = {"device": "cpu", "eval_interval": 2, "warmup_steps": 2, "max_steps": 6}
    if task in ("lm", "mlm"):
        text = {"data": str(data["text"]), "block_size": 32, "batch_size": 4, "model": {**_TINY_MODEL, "n_layers": 1}}
        extra = {"sample_tokens": 0, "eval_tokens": 600} if task == "lm" else {"vocab_size": 300}
        return {**common, **text, **extra}
    # The language model's block (SwiGLU, no biases) rather than the paper's (ReLU, biases): parameters whose true
    # gradient is zero or nearly so (a key projection's bias, whose q·b the softmax cancels; a ReLU unit active on
    # one token) get updates from float noise under Adam, so two ways of summing one gradient would part there.
    block = {"activation": "swiglu", "bias": False}
    seq2seq = {"model": {**_TINY_MODEL, **block, "d_ff": 64, "n_encoder_layers": 1, "n_decoder_layers": 1}}
    if task == "translate":  # buckets of pairs of varied length
        return {**common, **seq2seq, "data": str(data["pairs"]), "vocab_size": 300, "batch_size": 200,
                "max_time": None}  # fmt: skip
    return {**common, **seq2seq, "batch_size": 8, "length": 8, "min_length": 3, "n_test": 20}  # varied lengths


def cli_args(settings: dict[str, Any]) -> list[str]:
    """The `qkv train TASK` options that give these settings."""
    args: list[str] = []
    for name, value in settings.items():
        if name == "model":
            args += [a for key, v in value.items() for a in ("--model", f"{key}={v}")]
        elif value is True:
            args.append(f"--{name.replace('_', '-')}")
        else:
            args += [f"--{name.replace('_', '-')}", "none" if value is None else str(value)]
    return args


def tiny_data(root: Path) -> dict[str, Path]:
    """A 20,000-character text and 300 German–English pairs (as TSV), written under root."""
    from qkv.data import load_shakespeare
    from qkv.translation.corpus import load_de_en

    root.mkdir(parents=True, exist_ok=True)
    text, pairs = root / "excerpt.txt", root / "pairs.tsv"
    text.write_text(load_shakespeare()[:20_000], encoding="utf-8")
    pairs.write_text("".join(f"{de}\t{en}\n" for de, en in load_de_en()[:300]), encoding="utf-8")
    return {"text": text, "pairs": pairs}


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a `python -m qkv` subprocess: one thread (like one_thread()), unbuffered output."""
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
