"""Beam search as transformers' `generate` does it, so that a checkpoint trained for it (MarianMT) decodes alike.

It differs from GNMT's beam search (decoding.beam_search) in these ways, all transformers' choices:
- a finished hypothesis scores Σ log P / |Y|^lp, |Y| = its generated tokens, </s> included; live hypotheses
  are ranked by Σ log P alone (no normalisation while they grow);
- every step keeps the 2K best continuations of the K beams: those among the top K that end in </s> (or
  reach the maximum length) become finished candidates, and the K best others stay live;
- finished hypotheses go to a separate list of the K best; a sentence stops when no live beam could beat
  the worst of them any more (early_stopping False: judged at the current length; "never": at the maximum
  length when lp > 0; True: as soon as K hypotheses are finished);
- with forced_eos (transformers' forced_eos_token_id), the last allowed token is </s>.
The code follows transformers' `_beam_search` (generation/utils.py) step by step, with static-shaped
(B, K, L) tensors and the same −1e9 offsets, so that equal log-probabilities give equal tokens; the model
calls are qkv's, with its KV cache. Greedy decoding (K = 1) is transformers' plain argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from qkv.attention.masks import padding_mask_from_ids
from qkv.errors import QkvError
from qkv.io.devices import cpu_threads
from qkv.models import Transformer
from qkv.translation.batching import Specials
from qkv.translation.decoding import _Stepper, _strip, default_max_len, greedy_decode

EarlyStopping = bool | Literal["never"]
NEG = -1.0e9  # transformers' score for what must not be chosen: finite, so that sums stay comparable


def check_early_stopping(early_stopping: object) -> None:
    """Refuse an early_stopping other than transformers' True, False or "never"."""
    if early_stopping not in (True, False, "never"):
        raise QkvError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")


@dataclass
class _Beams:
    """What transformers' beam search carries from step to step, per sentence (B) and beam (K)."""

    running: Tensor  # (B, K, L) live hypotheses, start token first, then filler
    running_scores: Tensor  # (B, K) their Σ log P
    finished: Tensor  # (B, K, L) the best finished hypotheses so far, best first
    finished_scores: Tensor  # (B, K) their Σ log P / |Y|^lp (NEG: an empty slot)
    is_finished: Tensor  # (B, K) whether a slot holds a finished hypothesis
    improvable: Tensor  # (B, 1) whether a live beam may still beat the finished ones

    @classmethod
    def start(cls, b: int, k: int, length: int, sp: Specials, device: torch.device) -> _Beams:
        """K copies of the start token per sentence; only the first may expand (the others start at NEG)."""
        running = torch.full((b, k, length), sp.pad, dtype=torch.int64, device=device)
        running[:, :, 0] = sp.bos
        scores = torch.zeros(b, k, device=device)
        scores[:, 1:] = NEG
        return cls(running, scores, running.clone(), torch.full((b, k), NEG, device=device),
                   torch.zeros(b, k, dtype=torch.bool, device=device),
                   torch.ones(b, 1, dtype=torch.bool, device=device))  # fmt: skip


def _gather(t: Tensor, index: Tensor) -> Tensor:
    """t (B, N, ...) at the beams index (B, M) names: (B, M, ...)."""
    return torch.take_along_dim(t, index.view(*index.shape, *([1] * (t.dim() - 2))), dim=1)


def _step(
    beams: _Beams, log_probs: Tensor, t: int, eos: int, lp: float, early_stopping: EarlyStopping
) -> tuple[Tensor, Tensor]:
    """Extend the beams by one token: the rows (B·K,) the new live beams extend, and which candidates ended (B, 2K)."""
    b, k, length = beams.running.shape
    vocab = log_probs.shape[-1]
    total = (log_probs.view(b, k, vocab) + beams.running_scores[..., None]).view(b, k * vocab)
    top_scores, top = torch.topk(total, 2 * k)  # (B, 2K): enough to keep K live even if K of them just ended
    beam, token = top // vocab, top % vocab
    candidates = _gather(beams.running, beam)  # (B, 2K, L), a copy
    candidates[:, :, t] = token
    hits = (token == eos) | (t + 1 >= length)  # (B, 2K): ended by </s>, or by the maximum length
    # The K best continuations that did not end stay live.
    live_scores = top_scores + hits.to(torch.float32) * NEG
    keep = torch.topk(live_scores, k).indices  # (B, K)
    beams.running, beams.running_scores = _gather(candidates, keep), _gather(live_scores, keep)
    rows = _gather(beam + torch.arange(b, device=beam.device)[:, None] * k, keep)  # (B, K) flat rows extended
    # Those of the top K that ended compete, length-normalised, for the K finished slots.
    ended = hits & (torch.arange(2 * k, device=hits.device) < k)[None, :]
    scores = top_scores / (t**lp)  # t generated tokens, </s> included
    full = beams.is_finished.all(-1, keepdim=True) & (early_stopping is True)
    scores += full.to(torch.float32) * NEG
    scores += (~beams.improvable).to(torch.float32) * NEG
    scores += (~ended) * NEG
    merged_scores = torch.cat([beams.finished_scores, scores], dim=1)  # (B, 3K)
    best = torch.topk(merged_scores, k).indices
    beams.finished = _gather(torch.cat([beams.finished, candidates], dim=1), best)
    beams.finished_scores = _gather(merged_scores, best)
    beams.is_finished = _gather(torch.cat([beams.is_finished, ended], dim=1), best)
    return rows.view(-1), hits


def _update_improvable(beams: _Beams, generated: int, max_new: int, lp: float, early_stopping: EarlyStopping) -> None:
    """Can the best live beam still beat the worst finished one? (transformers' heuristic; sticky once False)."""
    best_len = max_new if early_stopping == "never" and lp > 0.0 else generated
    best_possible = beams.running_scores[:, :1] / (best_len**lp)  # (B, 1)
    worst = torch.where(beams.is_finished, beams.finished_scores.min(dim=1, keepdim=True)[0], NEG)  # (B, K)
    beams.improvable = beams.improvable & (best_possible > worst).any(dim=-1, keepdim=True)


def _forced_eos(log_probs: Tensor, eos: int) -> Tensor:
    """transformers' ForcedEOSTokenLogitsProcessor: only </s>, at log P 0."""
    forced = torch.full_like(log_probs, -torch.inf)
    forced[:, eos] = 0.0
    return forced


@torch.no_grad()
@cpu_threads(1)  # a step multiplies tiny matrices (B × d_model): a second thread only waits (io.devices)
def hf_beam_search(
    model: Transformer,
    src: Tensor,
    sp: Specials,
    beam_size: int = 4,
    length_penalty: float = 1.0,
    early_stopping: EarlyStopping = False,
    max_len: int | None = None,
    forced_eos: bool = False,
    use_cache: bool = True,
) -> list[list[int]]:
    """The best of `beam_size` hypotheses per source row (B, S), scored and stopped as transformers does."""
    check_early_stopping(early_stopping)
    b, k = src.shape[0], beam_size
    src_mask = padding_mask_from_ids(src, sp.pad)  # (B, 1, 1, S)
    max_len = default_max_len(src, model) if max_len is None else max_len
    memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)  # (B·K, S, d): beams of a sentence adjacent
    stepper = _Stepper(model, memory, src_mask.repeat_interleave(k, dim=0), use_cache, max_len + 1, sp.pad)
    beams = _Beams.start(b, k, max_len + 1, sp, src.device)  # transformers' max_length = start token + max_len
    t = 1  # tokens in every hypothesis so far
    while True:
        log_probs = stepper.log_probs(beams.running[:, :, :t].reshape(b * k, t))  # (B·K, V), <pad> at −∞
        if forced_eos and t == max_len:
            log_probs = _forced_eos(log_probs, sp.eos)
        rows, hits = _step(beams, log_probs, t, sp.eos, length_penalty, early_stopping)
        stepper.reorder(rows)
        _update_improvable(beams, t, max_len, length_penalty, early_stopping)
        t += 1
        stop_full = bool(beams.is_finished.all()) and early_stopping is True
        if not bool(beams.improvable.any()) or stop_full or bool(hits.all()):
            break
    return _strip(beams.finished[:, 0], sp)


def hf_generate(
    model: Transformer,
    src: Tensor,
    sp: Specials,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: EarlyStopping = False,
    max_len: int | None = None,
    forced_eos: bool = False,
) -> list[list[int]]:
    """transformers' generate without sampling: greedy for num_beams 1, else its beam search."""
    if num_beams < 1:
        raise QkvError(f"num_beams must be ≥ 1, got {num_beams}")
    if num_beams > 1:
        return hf_beam_search(model, src, sp, num_beams, length_penalty, early_stopping, max_len, forced_eos)
    max_len = default_max_len(src, model) if max_len is None else max_len
    # Forcing </s> as the last token is greedy decoding one token shorter: that </s> is stripped anyway.
    return greedy_decode(model, src, sp, max_len - 1 if forced_eos else max_len)
