"""The explorer's "your model" panel: which runs it may open, and what a loaded run computes for the page.

Attention maps come from qkv.lab.attention_map (the recorder of qkv.attention), next-token
distributions from qkv.generation's own filter and sampler: the page shows the numbers the Python
API gives. Matrices travel packed: {"shape": [...], "data": base64 of little-endian float32}, exact
and a fraction of the size of JSON numbers (a full 128-token map of 3 layers × 4 heads is 196,608 weights).
"""

from __future__ import annotations

import base64
import functools
import threading
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from qkv.attention import record_attention
from qkv.engine import Engine, Request
from qkv.errors import QkvError
from qkv.generation import Sampling, next_token_probs
from qkv.lab.attention_map import run_attention_maps
from qkv.lab.softmax import entropy
from qkv.models import DecoderLM

TOP_TOKENS = 20  # rows of the next-token chart
CHAT_OPENING = "Hello! What can you do?"  # a chat run's first message on the page
MAX_WEIGHTS = 1 << 24  # attention weights of one text, all layers and heads: 64 MB of float32 (and as many scores)
_ENGINES_LOCK = threading.Lock()


def pack(array: np.ndarray | torch.Tensor) -> dict[str, Any]:
    """A matrix as its shape and its float32 bytes in base64 (the page reads it into a Float32Array)."""
    a = np.ascontiguousarray(np.asarray(array, dtype="<f4"))
    return {"shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def describe(run: Any) -> dict[str, Any]:
    """What the page needs to set up its controls for a run: task, layers, heads and context length."""
    cfg = run.model.cfg
    return {"task": run.task, "n_layers": max(cfg.depths()), "n_heads": cfg.max_heads(),
            "max_positions": cfg.context_length, "causal": isinstance(run.model, DecoderLM),
            "chat_prompt": chat_prompt(run)}  # fmt: skip


def chat_prompt(run: Any) -> str | None:
    """A chat run's (one trained on conversations) opening text: a first message in its own template, ready for
    the reply, so the page shows the roles' markers and the model answers; None for other runs."""
    from qkv.chat import ChatTemplate
    from qkv.chat.template import TEMPLATE_FILE

    template = getattr(run, "directory", None) and run.directory / TEMPLATE_FILE
    if not template or not template.is_file():
        return None
    first = [{"role": "user", "content": CHAT_OPENING}]
    source = template.read_text(encoding="utf-8")
    return ChatTemplate.of(source, run.require_tokenizer()).render(first, add_generation_prompt=True)


def attention(run: Any, text: str, layer: int | None = None, head: int | None = None) -> dict[str, Any]:
    """Every layer's and head's weights and pre-softmax scores on `text`, grouped by kind (self, encoder, …).

    layer, head: only that layer (and head) of each kind, as (1, 1 or H, T_q, T_k) arrays.
    """
    _check_size(run, text)
    n_layers, n_heads = max(run.model.cfg.depths()), run.model.cfg.max_heads()
    if layer is not None and not 0 <= layer < n_layers:
        raise QkvError(f"layer {layer} is out of range: the model has layers 0 to {n_layers - 1}")
    if head is not None and not 0 <= head < n_heads:
        raise QkvError(f"head {head} is out of range: the model has heads 0 to {n_heads - 1}")
    heads = slice(None) if head is None else slice(head, head + 1)
    result = run_attention_maps(run, text)
    kinds: dict[str, Any] = {}
    for m in (m for m in result.maps if layer is None or m.layer == layer):
        kind = kinds.setdefault(m.kind, {"query_tokens": m.query_tokens, "key_tokens": m.key_tokens,
                                         "weights": [], "scores": []})  # fmt: skip
        assert m.scores is not None  # recorded maps carry their scores
        kind["weights"].append(m.weights[heads])
        kind["scores"].append(m.scores[heads])
    for kind in kinds.values():  # (layers, heads, T_q, T_k) each
        kind["weights"], kind["scores"] = pack(np.stack(kind["weights"])), pack(np.stack(kind["scores"]))
    out: dict[str, Any] = {"model_type": result.model_type, "kinds": kinds}
    if result.translation is not None:
        out["translation"] = result.translation
    return out


def _check_size(run: Any, text: str) -> None:
    """Refuse a text whose maps (every layer and head) would not fit in memory: a long text on a large model."""
    cfg = run.model.cfg
    layers = sum(cfg.depths()) + (cfg.depths()[-1] if run.task == "translate" else 0)  # cross-attention too
    n = len(run.require_tokenizer().encode(text))
    n *= 2 if run.task == "translate" else 1  # a translation's output is about as long again
    limit = int((MAX_WEIGHTS / (layers * cfg.max_heads())) ** 0.5)
    if n > limit:
        raise QkvError(f"the text is about {n} tokens long; this model's maps (every layer and head) hold at most "
                       f"{limit} tokens: shorten it")  # fmt: skip


def _language_model(run: Any) -> DecoderLM:
    """The run's model, or a 400 for a run that does not predict the next token."""
    if not isinstance(run.model, DecoderLM):
        raise QkvError(f"a {run.task} run does not predict the next token; open a language-model run")
    model: DecoderLM = run.model
    return model


def _ids(run: Any, text: str | None, ids: list[int] | None) -> list[int]:
    """The token ids to continue: the page's own ids when it has them (exact), else the text encoded."""
    tokenizer = run.require_tokenizer()
    if ids is None:
        if not text:
            raise QkvError("the text is empty; type something for the model to continue")
        ids = list(tokenizer.encode(text))
    if not ids:
        raise QkvError("the text encodes to no tokens")
    vocab = run.model.cfg.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise QkvError(f"token ids must be between 0 and {vocab - 1}")
    return ids


def _engine(model: DecoderLM) -> tuple[Engine, threading.Lock]:
    """The model's one-slot engine (and the lock its callers take): the slot keeps the last window read, so the next
    step's window, one token longer, reads only that token."""
    with _ENGINES_LOCK:
        return _new_engine(model)


@functools.lru_cache(maxsize=4)  # the runs a page steps through; an older one's engine (and its cache) is let go
def _new_engine(model: DecoderLM) -> tuple[Engine, threading.Lock]:
    return Engine(model, max_batch=1), threading.Lock()


def _next(model: DecoderLM, window: list[int], sampling: Sampling, record: bool = False,
          ) -> tuple[torch.Tensor, int, list[torch.Tensor]]:  # fmt: skip
    """One token after the window, generated through qkv's engine: the logits (V,) it was sampled from, the token,
    and, if `record`, each layer's attention row of the window's last token (H, T)."""
    engine, lock = _engine(model)
    seen: list[torch.Tensor] = []
    request = Request(window, 1, sampling, slide=True, observe=seen.append)
    # Only recorded attention leaves the fused kernel: nothing is recorded that nobody reads.
    recording = record_attention(model, only="decoder.layers.*.self_attn") if record else nullcontext(None)
    with lock, recording as recorder:
        try:
            [(tokens, _)] = engine.generate([request])
        except BaseException:
            engine.abort()  # a step that failed midway leaves no half-read slot behind
            raise
    rows = []
    if recorder is not None:  # the last forward's records, one per layer: its last query's row in each head
        for weights in recorder.weights_of()[-len(model.decoder.layers) :]:
            row = weights[0, :, -1].float().cpu()  # (H, T_k): a sliding window's cache keeps the last keys only
            rows.append(torch.nn.functional.pad(row, (len(window) - row.shape[-1], 0)))
    return seen[0].float(), tokens[0].id, rows


def _distribution(logits: torch.Tensor, sampling: Sampling, tokenizer: Any) -> dict[str, Any]:
    """The next-token distribution as the model gives it and as temperature, top-k and top-p reshape it."""
    base = torch.softmax(logits, dim=-1)
    shaped = next_token_probs(logits[None], sampling)[0]
    top = torch.argsort(base, descending=True)[:TOP_TOKENS].tolist()
    return {
        "tokens": [tokenizer.decode([i]) for i in top],  # the first is the greedy choice
        "ids": top,
        "model_probs": [float(base[i]) for i in top],
        "probs": [float(shaped[i]) for i in top],
        "kept": int((shaped > 0).sum()),
        "entropy": float(entropy(shaped.double().numpy())),
    }


def next_token(run: Any, text: str | None, ids: list[int] | None, sampling: Sampling) -> dict[str, Any]:
    """The next-token distribution after the text (its last max_positions tokens, as generation reads them)."""
    model = _language_model(run)
    window = _ids(run, text, ids)[-model.cfg.context_length :]
    logits, _, _ = _next(model, window, sampling)
    return _distribution(logits, sampling, run.require_tokenizer())


def step(run: Any, text: str | None, ids: list[int] | None, sampling: Sampling) -> dict[str, Any]:
    """One generation step, through qkv's engine: the token it picks, and the attention row that produced it."""
    model = _language_model(run)
    tokenizer = run.require_tokenizer()
    ids = _ids(run, text, ids)
    window = ids[-model.cfg.context_length :]
    logits, token, weights = _next(model, window, sampling, record=True)
    rows = torch.stack(weights)  # (layers, heads, T): the last query's row in each head
    return {
        "token": token,
        "token_text": tokenizer.decode([token]),
        "ids": [*ids, token],
        "text": tokenizer.decode([*ids, token]),
        "window_tokens": [tokenizer.decode([i]) for i in window],
        "rows": pack(rows),
        "distribution": _distribution(logits, sampling, tokenizer),
    }
