"""Reading an SAE's features: which latents a text lights up, a latent's top-activating contexts (its dashboard),
the tokens its decoder direction promotes, and steering with it.

All of them read the SAE as SAELens saves it (SparseAutoencoder.folded): latents in the model's units (and a
TopK or BatchTopK SAE's decoder rows unit vectors), so that the numbers shown are the ones a SAELens copy shows.

    token_latents(lm, sae, hook, ids)                   each position's most active latents (top_latents of them)
    top_contexts(lm, sae, hook, windows, latent)        the highest activations over held-out windows, in context
    promoted_tokens(lm, sae, latent)                    the decoder row through the unembedding (logit lens)
    steered(lm, sae, hook, ids, latent, alpha, n)       greedy text with α × the decoder row added at the hook
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.generation import Sampling, stream
from qkv.interpret.hooks import hooked
from qkv.interpret.lens import readout_of
from qkv.sae.activations import Filters, read_activation
from qkv.sae.model import SparseAutoencoder

KEEP_ALL = Filters(drop_first=False, bos_id=None, max_norm_ratio=None)
MAX_ALPHA = 1e4  # steering strengths beyond this only print one token over and over


def check_text(lm: nn.Module, ids: Tensor, what: str = "text") -> Tensor:
    """ids (1, T), refused in one line when empty or longer than the model's context."""
    cfg: Any = lm.cfg
    context = int(cfg.context_length)
    if ids.shape[-1] == 0:
        raise QkvError(f"the {what} is empty; give some text")
    if ids.shape[-1] > context:
        raise QkvError(f"the {what} is {ids.shape[-1]} tokens long but the model reads at most {context}; shorten it")
    return ids


def check_alpha(alpha: float) -> float:
    """A steering strength, or a one-line error when it is not a finite number within ±MAX_ALPHA."""
    if not (math.isfinite(alpha) and abs(alpha) <= MAX_ALPHA):
        raise QkvError(f"the steering strength α must be a finite number between {-MAX_ALPHA:g} and {MAX_ALPHA:g}, "
                       f"got {alpha:g}")  # fmt: skip
    return alpha


def check_latent(sae: SparseAutoencoder, latent: int) -> int:
    """The latent's index, or a one-line error giving the range."""
    if not 0 <= latent < sae.cfg.latents:
        raise QkvError(f"latent {latent} does not exist: this SAE has latents 0–{sae.cfg.latents - 1}")
    return latent


def latents_of(lm: nn.Module, sae: SparseAutoencoder, hook: str, ids: Tensor) -> Tensor:
    """(B, T, d_sae) the latents of each position of ids (B, T)."""
    return encoded(sae, read_activation(lm, hook, ids.to(next(lm.parameters()).device)))


def kept_latents(lm: nn.Module, sae: SparseAutoencoder, hook: str, ids: Tensor,
                 filters: Filters | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(B, T, d_sae) the latents of ids (B, T), and (B, T) bool on their device: the positions `filters` keep (all,
    without filters), from one read of the activation."""
    stream = read_activation(lm, hook, ids.to(next(lm.parameters()).device))  # (B, T, d)
    latents = encoded(sae, stream)
    return latents, (filters or KEEP_ALL).mask(ids, stream).to(latents.device)


def encoded(sae: SparseAutoencoder, stream: Tensor) -> Tensor:
    """(…, d_sae) the latents of activations (…, d) read at the SAE's hook, on the SAE's device."""
    with torch.no_grad():
        return sae.encode(stream.to(next(sae.parameters()).device).float())


def token_latents(lm: nn.Module, sae: SparseAutoencoder, hook: str, ids: Tensor,
                  top: int = 5) -> list[list[tuple[int, float]]]:  # fmt: skip
    """For each position of one text's ids (1, T): its `top` most active latents, (latent, activation), active only."""
    return top_latents(latents_of(lm, sae, hook, check_text(lm, ids))[0], top)


def top_latents(latents: Tensor, top: int = 5) -> list[list[tuple[int, float]]]:
    """For each row of latents (T, d_sae): its `top` most active latents, (latent, activation), active only."""
    values, indices = latents.topk(min(top, latents.shape[-1]), dim=-1)
    pairs = zip(values.tolist(), indices.tolist(), strict=True)
    return [[(i, v) for v, i in zip(vs, ix, strict=True) if v > 0] for vs, ix in pairs]


@dataclass(frozen=True)
class Context:
    """One top activation of a latent: the window's tokens around it and the latent's value at each."""

    tokens: list[int]  # the window's ids from `start`, the activating one included
    values: list[float]  # the latent's activation at each of them
    at: int  # the activating token's index in tokens
    value: float  # its activation


def top_contexts(lm: nn.Module, sae: SparseAutoencoder, hook: str, windows: Iterable[tuple[Tensor, Tensor]],
                 latent: int, top: int = 10, before: int = 12, after: int = 3,
                 filters: Filters | None = None) -> list[Context]:  # fmt: skip
    """The latent's `top` highest activations over the windows (B, T) (its dashboard), each with `before` tokens
    before it and `after` after it; a position counts once, its window's other positions may appear again.
    filters: the positions the SAE's training left out, which then count as 0 (else a window's first position, the
    attention sink with its outsized activations, tops many latents' dashboards)."""
    searched = searched_contexts(lm, sae, hook, windows, latent, top, before, after, filters)
    last = deque(searched, maxlen=1)  # the final step
    return last[0] if last else []


def searched_contexts(lm: nn.Module, sae: SparseAutoencoder, hook: str, windows: Iterable[tuple[Tensor, Tensor]],
                      latent: int, top: int = 10, before: int = 12, after: int = 3,
                      filters: Filters | None = None) -> Iterator[list[Context]]:  # fmt: skip
    """top_contexts one batch of windows at a time: after each batch, the top contexts found so far (the explorer
    shows a dashboard filling as the search goes)."""
    check_latent(sae, latent)
    found: list[tuple[float, Tensor, Tensor, int]] = []  # (value, window ids, window activations, position)
    for ids, _ in windows:
        latents, kept = kept_latents(lm, sae, hook, ids, filters)
        acts = (latents[..., latent] * kept).cpu()  # (B, T), a copy: not a view of all the latents
        values, flat = acts.flatten().topk(min(top, acts.numel()))
        for value, index in zip(values.tolist(), flat.tolist(), strict=True):
            if value > 0:
                row, pos = divmod(index, acts.shape[1])
                found.append((value, ids[row].cpu(), acts[row], pos))
        found = sorted(found, key=lambda f: -f[0])[:top]
        yield [_context(value, ids, acts, pos, before, after) for value, ids, acts, pos in found]


def _context(value: float, ids: Tensor, acts: Tensor, pos: int, before: int, after: int) -> Context:
    """The activation at `pos` of one window (T,), with `before` tokens before it and `after` after."""
    lo, hi = max(0, pos - before), min(len(ids), pos + after + 1)
    return Context(ids[lo:hi].tolist(), acts[lo:hi].tolist(), pos - lo, value)


def promoted_tokens(lm: nn.Module, sae: SparseAutoencoder, latent: int,
                    top: int = 10) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:  # fmt: skip
    """The tokens whose logits the latent's decoder row raises most and lowers most, as (token id, logit change per
    unit of activation): the row through the output head, scaled by the final norm's gain (its linear part; the
    norm's division by the stream's scale is the same for every token)."""
    check_latent(sae, latent)
    readout = readout_of(lm)
    direction = sae.W_dec[latent].detach()  # (d,)
    gain = getattr(readout.norm, "weight", None)
    if isinstance(gain, Tensor):
        direction = direction * gain.detach().to(direction.device)
    weight = getattr(readout.head, "weight", None)
    if not isinstance(weight, Tensor):
        raise QkvError("the logit lens of a latent needs a model whose output head is one linear map")
    with torch.no_grad():
        logits = weight.float() @ direction.float().to(weight.device)  # (V,)
    top = min(top, logits.numel())
    up, down = logits.topk(top), (-logits).topk(top)
    return ([(int(i), float(v)) for v, i in zip(up.values, up.indices, strict=True)],
            [(int(i), -float(v)) for v, i in zip(down.values, down.indices, strict=True)])  # fmt: skip


def steered(lm: nn.Module, sae: SparseAutoencoder, hook: str, ids: Tensor, latent: int, alpha: float,
            max_new_tokens: int, eos_id: int | None = None) -> list[int]:  # fmt: skip
    """Greedy continuation of ids (1, T) with α × the latent's decoder row added to the hook at every position
    (α = 0: the model as it is)."""
    check_latent(sae, latent)
    check_text(lm, ids, "prompt")
    direction = (check_alpha(alpha) * sae.W_dec[latent].detach()).to(next(lm.parameters()).device)

    def add(a: Tensor) -> Tensor:
        return a + direction.to(a.dtype)

    with torch.no_grad(), hooked(lm, patch={hook: add} if alpha else None):
        tokens = [int(t[0]) for t in stream(lm, ids, max_new_tokens, Sampling(temperature=0.0), eos_id)]  # type: ignore[arg-type]
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens
