"""The numbers of the explorer's teaching panels, computed by qkv.lab and the core, as JSON-ready dicts.

Each function takes already-checked Python values (the server checks the request) and returns what
its panel draws. None of them holds state: the page sends the whole table with every edit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from qkv.errors import QkvError
from qkv.lab.heads import heads
from qkv.lab.positional import rotation
from qkv.lab.softmax import entropy, softmax_jacobian
from qkv.lab.walkthrough import CLASSIC, TRAINABLE_SENTENCE, trainable_walkthrough, walkthrough
from qkv.norms import BatchNorm, LayerNorm, RMSNorm
from qkv.positional import sinusoidal_table

MAX_WORDS = 32  # the spreadsheet's and the trainable panel's limits: a page, not a corpus
MAX_DIMS = 16
HEAD_COUNTS = (1, 2, 4, 8, 16)  # divisors of the multi-head view's d_model = 512
MAX_PE_LENGTH = 512
NORM_LIMIT = 16  # rows and features of the editable norms batch


def _rounded(a: np.ndarray | float, digits: int = 10) -> Any:
    """An array (or number) as nested lists of floats, rounded so the JSON stays short."""
    return np.round(np.asarray(a, dtype=np.float64), digits).tolist()


def classic_table() -> dict[str, Any]:
    """The classic spreadsheet's words and embeddings (one 3-number vector per word), the page's starting table."""
    return {"words": list(CLASSIC), "embeddings": [list(v) for v in CLASSIC.values()], "query": len(CLASSIC) - 1}


def spreadsheet(words: Sequence[str], embeddings: Sequence[Sequence[float]], query: int, sqrt_scale: bool = True,
                factor: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """Every stage of the query word's attention (qkv.lab.walkthrough) and the softmax's saturation measures.

    The scores are multiplied by `factor`, and by 1/√d as well when sqrt_scale is on.
    """
    if not 1 <= len(words) <= MAX_WORDS:
        raise QkvError(f"the table needs between 1 and {MAX_WORDS} words, got {len(words)}")
    d = len(embeddings[0]) if embeddings else 0
    if not 1 <= d <= MAX_DIMS:
        raise QkvError(f"each word needs between 1 and {MAX_DIMS} numbers, got {d}")
    if not math.isfinite(factor) or abs(factor) > 1e6:
        raise QkvError(f"the scale must be a finite number below 1e6 in size, got {factor}")
    scale = factor / math.sqrt(d) if sqrt_scale else factor
    result = walkthrough(words, embeddings, int(query), scale)
    weights = result.weights
    return {
        "words": result.words,
        "query": result.query_index,
        "d": d,
        "scale": scale,
        "dot_products": _rounded(result.embeddings @ result.embeddings[result.query_index]),
        "scores": _rounded(result.scores),
        "exp_scores": _rounded(result.exp_scores),
        "exp_shift": result.exp_shift,
        "weights": _rounded(weights, 12),
        "weighted": _rounded(result.weighted),
        "before": _rounded(result.embeddings[result.query_index]),
        "context": _rounded(result.context),
        "max_prob": float(weights.max()),
        "entropy": float(entropy(weights)),
        "jacobian_norm": float(np.linalg.norm(softmax_jacobian(weights))),
    }


def trainable(seed: int, causal: bool, sentence: str = TRAINABLE_SENTENCE) -> dict[str, Any]:
    """Self-attention with seeded W_q, W_k, W_v (8 × 4) on a short sentence: every matrix on the way."""
    words = sentence.split()
    if not 1 <= len(words) <= MAX_WORDS:
        raise QkvError(f"the sentence needs between 1 and {MAX_WORDS} words, got {len(words)}")
    t = trainable_walkthrough(sentence, d_in=8, d_out=4, seed=seed, causal=causal)
    d_out = t.w_q.shape[1]
    matrices = {"x": t.x, "w_q": t.w_q, "w_k": t.w_k, "w_v": t.w_v, "q": t.q, "k": t.k, "v": t.v,
                "scores": t.scores, "weights": t.weights, "context": t.context}  # fmt: skip
    out: dict[str, Any] = {name: _rounded(m) for name, m in matrices.items()}
    # −inf where masked: JSON has no −∞, so it travels as null and the page writes "−∞"
    out["scaled"] = [[round(v, 10) if math.isfinite(v) else None for v in row] for row in t.scaled.tolist()]
    return {"words": words, "d_in": t.w_q.shape[0], "d_out": d_out, "causal": causal, **out}


def multi_head(n_heads: int, seed: int, seq_len: int = 6, d_model: int = 512) -> dict[str, Any]:
    """A real MultiHeadAttention split into heads, step by step with shapes (qkv.lab.heads), and each head's weights."""
    if n_heads not in HEAD_COUNTS:
        raise QkvError(f"n_heads must be one of {', '.join(map(str, HEAD_COUNTS))} (they divide {d_model})")
    result = heads(seq_len, d_model, n_heads, seed)
    return {
        "tokens": result.tokens,
        "d_model": d_model,
        "n_heads": n_heads,
        "d_k": d_model // n_heads,
        "steps": [{"name": n, "formula": f, "shape": list(s)} for n, f, s in result.steps],
        "weights": _rounded(result.weights, 8),
        "max_abs_diff": result.max_abs_diff,
        "n_params": result.n_params,
    }


def positions(d_model: int, position: int, offset: int, max_len: int = 100) -> dict[str, Any]:
    """The sinusoidal table (qkv.positional), PE(p), PE(p+k) and M_k·PE(p): the shift is a rotation."""
    if d_model < 2 or d_model % 2 or d_model > 512:
        raise QkvError(f"d_model must be even, between 2 and 512, got {d_model}")
    if not 2 <= max_len <= MAX_PE_LENGTH:
        raise QkvError(f"max_len must be between 2 and {MAX_PE_LENGTH}, got {max_len}")
    if not 0 <= position < max_len or not 0 <= offset < max_len - position:
        raise QkvError(f"need 0 ≤ position < {max_len} and 0 ≤ position + offset < {max_len}, "
                       f"got position {position}, offset {offset}")  # fmt: skip
    pe = sinusoidal_table(max_len, d_model).double().numpy()  # (max_len, d_model)
    rotated = rotation(offset, d_model) @ pe[position]
    return {
        "d_model": d_model,
        "max_len": max_len,
        "table": _rounded(pe, 6),
        "position": position,
        "offset": offset,
        "pe_p": _rounded(pe[position]),
        "pe_p_k": _rounded(pe[position + offset]),
        "rotated": _rounded(rotated),
        "rotation_error": float(np.abs(rotated - pe[position + offset]).max()),
    }


def norms(batch: Sequence[Sequence[float]]) -> dict[str, Any]:
    """BatchNorm (this batch's statistics), LayerNorm and RMSNorm (qkv.norms) of a small (tokens, features) batch."""
    x = torch.tensor(batch, dtype=torch.float64)
    if x.dim() != 2 or not 2 <= x.shape[0] <= NORM_LIMIT or not 2 <= x.shape[1] <= NORM_LIMIT:
        raise QkvError(f"the batch must be a table of 2 to {NORM_LIMIT} tokens × 2 to {NORM_LIMIT} features, "
                       f"got shape {tuple(x.shape)}")  # fmt: skip
    if not torch.isfinite(x).all():
        raise QkvError("the batch must hold finite numbers")
    d = x.shape[1]
    modules = {"batch": BatchNorm(d), "layer": LayerNorm(d), "rms": RMSNorm(d)}
    out: dict[str, Any] = {"input": _stats(x)}
    with torch.no_grad():
        for name, module in modules.items():
            y = module.double().train()(x[None])[0]  # (tokens, features): one sequence, so batch = its tokens
            out[name] = _stats(y)
    return out


def _stats(y: torch.Tensor) -> dict[str, Any]:
    """A (tokens, features) table with each feature's mean and std and each token's mean, std and RMS."""
    return {
        "values": _rounded(y.numpy(), 6),
        "feature_mean": _rounded(y.mean(0).numpy(), 6),
        "feature_std": _rounded(y.std(0, unbiased=False).numpy(), 6),
        "token_mean": _rounded(y.mean(1).numpy(), 6),
        "token_std": _rounded(y.std(1, unbiased=False).numpy(), 6),
        "token_rms": _rounded(y.pow(2).mean(1).sqrt().numpy(), 6),
    }
