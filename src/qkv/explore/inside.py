"""The explorer's "inside the model" panel: the logit lens and every head's induction scores (qkv.interpret).

Each function takes a loaded run and already-checked values and returns a JSON-ready dict whose numbers are
qkv.interpret's own (tests/test_explore_inside.py compares them to 1e-5). Activation patching, which takes
seconds on a real model and fills its map layer by layer, is in patch_jobs.py; the checks they share are here.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from qkv.errors import QkvError
from qkv.explore.library import RequestError
from qkv.interpret import head_scores, logit_lens, readout_of, repeated_tokens
from qkv.models import DecoderLM, EncoderModel

LENS_TOP = 5  # tokens per cell: the first is drawn, all of them are in its tooltip
MAX_TOP = 10
MAX_LENS_TOKENS = 64  # columns of the grid: a page, not a document
MAX_LENS_LOGITS = 1 << 25  # (L + 1) × T × vocab float32 logits held at once, and as many probabilities besides
REPEAT_LENGTH = 25  # as `qkv interpret heads`
MAX_REPEAT = 128  # random tokens before they repeat, in the induction measurement
MAX_REPEAT_BATCH = 8
HEAVY_SLOTS = 2  # lens and head-score computations at once (two cores: more only slows each one down)
HEAVY_WAIT_S = 60.0
TOP_HEADS = 5
_heavy = threading.BoundedSemaphore(HEAVY_SLOTS)
_scores: OrderedDict[tuple[int, int, int, int], dict[str, Any]] = OrderedDict()  # head scores, by model and settings
_scores_lock = threading.Lock()
KEPT_SCORES = 32


@contextlib.contextmanager
def heavy_slot() -> Iterator[None]:
    """Hold one of the HEAVY_SLOTS while a large forward pass runs; a 429 after HEAVY_WAIT_S of waiting."""
    if not _heavy.acquire(timeout=HEAVY_WAIT_S):
        raise RequestError(429, f"the explorer is busy with {HEAVY_SLOTS} other computations; try again shortly")
    try:
        yield
    finally:
        _heavy.release()


def single_stack(run: Any) -> nn.Module:
    """The run's model when it reads one text (a language model or a masked LM), else a one-line 400."""
    model = run.model
    if not isinstance(model, (DecoderLM, EncoderModel)):
        raise QkvError(f"a {run.task} run reads two texts (a source and a target); the lens, patching and head "
                       "scores here read one: open a language-model or masked-LM run")  # fmt: skip
    result: nn.Module = model
    return result


def device_of(model: nn.Module) -> torch.device:
    """Where the model's weights live (the ids go there too)."""
    return next(model.parameters()).device


def prompt_ids(run: Any, text: str, what: str, limit: int, view: str) -> list[int]:
    """The token ids of a typed prompt, refused (one line) when empty or longer than the view or the model reads."""
    return checked_ids(run.require_tokenizer(), run.model.cfg.context_length, text, what, limit,
                       f"{view} of this model")  # fmt: skip


def checked_ids(tokenizer: Any, context: int, text: str, what: str, limit: int, reader: str) -> list[int]:
    """The ids of a typed text, refused (one line) when empty or longer than the context or than `reader` reads."""
    if not text:
        raise QkvError(f"the {what} is empty; type some text")
    ids = list(tokenizer.encode(text))
    if not ids:
        raise QkvError(f"the {what} encodes to no tokens")
    if len(ids) > context:
        raise QkvError(f"the {what} is {len(ids)} tokens long but the model reads at most {context}; shorten it")
    if len(ids) > limit:
        raise QkvError(f"the {what} is {len(ids)} tokens long; {reader} reads at most {limit}: shorten it")
    return ids


def lens_limit(model: nn.Module) -> int:
    """The longest prompt the lens grid takes: MAX_LENS_TOKENS, fewer when (L + 1) × T × vocab logits would not fit."""
    cfg: Any = model.cfg
    return max(1, min(MAX_LENS_TOKENS, MAX_LENS_LOGITS // ((readout_of(model).n_layers + 1) * cfg.vocab_size)))


def pieces(tokenizer: Any, ids: Any) -> dict[str, str]:
    """Each distinct id's text (JSON keys are strings), so that a grid names each token once."""
    return {str(i): tokenizer.decode([i]) for i in sorted(set(ids))}


def lens(run: Any, text: str, k: int = LENS_TOP) -> dict[str, Any]:
    """The logit lens of `text`: per stream (L + 1) and position, the top-k tokens and their probabilities.

    A model without a final norm is no error: `note` says what the lens applies instead, and the page shows it.
    """
    model = single_stack(run)
    readout = readout_of(model)
    ids = prompt_ids(run, text, "text", lens_limit(model), "the lens")
    with heavy_slot():
        result = logit_lens(model, torch.tensor([ids], device=device_of(model)))
        probs, top = result.top(k)
    top_ids = top[:, 0].cpu()  # (L + 1, T, k)
    tokenizer = run.require_tokenizer()
    return {
        "labels": result.labels,
        "note": result.note,
        "final_norm": readout.norm is not None,
        "ids": ids,
        "tokens": [tokenizer.decode([i]) for i in ids],
        "k": k,
        "top_ids": top_ids.tolist(),
        "top_probs": probs[:, 0].cpu().tolist(),
        "pieces": pieces(tokenizer, top_ids.flatten().tolist()),
    }


def special_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens (end of text, mask, chat markers): none for a character vocabulary."""
    found = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        found |= {i for i, token in hf.get_added_tokens_decoder().items() if token.special}
    return found


def ordinary_range(tokenizer: Any, vocab: int) -> tuple[int, int]:
    """[low, high): ids of ordinary tokens to repeat. low skips the byte and special tokens most vocabularies start
    with (as `qkv interpret heads` does); high stops at the first special token above it (GPT-2's end of text)."""
    low = min(vocab // 10, 1000)
    high = min([i for i in special_ids(tokenizer) if i >= low] + [vocab])
    if high - low < 2:  # specials right after the first tenth: take the whole vocabulary but its specials' end
        low, high = 0, vocab
    return low, high


def repeat_limit(model: nn.Module) -> int:
    """The longest random sequence that fits twice in the model's context (at most MAX_REPEAT)."""
    cfg: Any = model.cfg
    return min(MAX_REPEAT, int(cfg.context_length) // 2)


def heads(run: Any, seed: int = 0, length: int | None = None, batch: int = 4) -> dict[str, Any]:
    """Induction and previous-token scores (L, H) of every self-attention head on `batch` sequences of `length`
    random ordinary tokens repeated twice (torch.Generator seeded with `seed`), and the top induction heads.

    length: REPEAT_LENGTH by default, fewer when twice that does not fit the model's context.
    """
    model = single_stack(run)
    limit = repeat_limit(model)
    length = min(REPEAT_LENGTH, limit) if length is None else length
    if not 2 <= length <= limit:
        raise QkvError(f"'length' must be between 2 and {limit} (twice it fits the model's context), got {length}")
    key = (id(model), seed, length, batch)
    with _scores_lock:
        if key in _scores:
            _scores.move_to_end(key)
            return _scores[key]
    tokenizer, cfg = run.require_tokenizer(), run.model.cfg
    low, high = ordinary_range(tokenizer, min(tokenizer.vocab_size, int(cfg.vocab_size)))
    ids = repeated_tokens(batch, length, high, torch.Generator().manual_seed(seed), low)
    stack = "decoder" if isinstance(model, DecoderLM) else "encoder"
    with heavy_slot():
        induction, previous = head_scores(model, ids.to(device_of(model)), stack)
    answer = {"induction": induction.cpu().tolist(), "previous": previous.cpu().tolist(), "seed": seed,
              "length": length, "batch": batch, "low": low, "high": high,
              "example": [tokenizer.decode([i]) for i in ids[0, :length].tolist()[:12]],
              "top": top_heads(induction.cpu(), previous.cpu())}  # fmt: skip
    with _scores_lock:
        _scores[key] = answer
        while len(_scores) > KEPT_SCORES:
            _scores.popitem(last=False)
    return answer


def top_heads(induction: torch.Tensor, previous: torch.Tensor, n: int = TOP_HEADS) -> list[dict[str, Any]]:
    """The n heads with the highest induction scores, best first, each with its previous-token score."""
    n_heads = induction.shape[1]
    values, order = induction.flatten().topk(min(n, induction.numel()))
    return [{"layer": int(k) // n_heads, "head": int(k) % n_heads, "induction": float(v),
             "previous": float(previous.flatten()[k])} for v, k in zip(values, order, strict=True)]  # fmt: skip
