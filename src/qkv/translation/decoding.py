"""Greedy decoding (through qkv's engine) and beam search for the encoder–decoder Transformer, batched, with a KV cache.

The source is encoded once. Cross-attention keys/values over that memory are computed at the first
decoding step and kept in the cache; each later step feeds only the newest target token, whose
self-attention keys/values are appended to the cache. Without the cache (use_cache=False) every step
re-runs the decoder over the whole prefix: slower, same output — the tests check that.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention import LayerCache, record_attention
from qkv.attention.masks import padding_mask_from_ids
from qkv.attention.slots import unslottable
from qkv.engine import Engine, Request
from qkv.engine.rows import SourceRows
from qkv.errors import QkvError
from qkv.generation import GREEDY
from qkv.io.devices import cpu_threads
from qkv.models import Transformer
from qkv.translation.batching import Specials

# qkv's defaults for GNMT's α and β, chosen on validation BLEU (measurements: benchmarks/TRANSLATION.md). GNMT
# used α = 0.6, β = 0.2, but β assumes cross-attention that covers each source token about once over a good
# translation; multi-head attention over BPE tokens does not, so β would reward long outputs that spread it.
LENGTH_PENALTY = 1.0
COVERAGE_PENALTY = 0.0


def default_max_len(src: Tensor, model: Transformer) -> int:
    """Output tokens allowed: 1.5 × the longest source + 10, within the model's positions."""
    return own_max_len(src.shape[1], model)


def own_max_len(source_tokens: int, model: Transformer) -> int:
    """Output tokens allowed for a source of source_tokens (its </s> included): 1.5 × that + 10, within the model's
    positions."""
    return min(int(source_tokens * 1.5) + 10, model.cfg.context_length - 1)


def check_penalties(length_penalty: float, coverage_penalty: float) -> None:
    """Refuse negative GNMT penalties (α, β), naming both."""
    if length_penalty < 0 or coverage_penalty < 0:
        raise QkvError(f"length and coverage penalties must be ≥ 0, got {length_penalty} and {coverage_penalty}")


def gnmt_length_penalty(length: Tensor, alpha: float) -> Tensor:
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^α (Wu et al., 2016); scores are log P / lp. α = 0: no normalisation."""
    return ((5.0 + length.float()) / 6.0) ** alpha


def gnmt_coverage_penalty(coverage: Tensor, src_pad: Tensor, beta: float) -> Tensor:
    """GNMT's cp(X; Y) = β · Σ_i log min(Σ_j p_ij, 1) over the non-pad source tokens i; coverage (..., S) → (...).

    p_ij is the attention target token j paid to source token i, so Σ_j p_ij is how much of source token i
    the hypothesis has "used". A hypothesis that stops before attending to every source token pays for each
    neglected one; this is the counterweight to beam search's preference for short outputs. cp ≤ 0; β = 0: none.
    """
    # The floor keeps an unattended token's log finite (softmax weights can underflow to 0 in float32).
    used = coverage.float().clamp(min=1e-6, max=1.0).masked_fill(src_pad, 1.0)
    return beta * used.log().sum(-1)


class _Stepper:
    """Next-token log-probabilities for a growing batch of target prefixes; padding is never a next token."""

    def __init__(
        self,
        model: Transformer,
        memory: Tensor,
        src_mask: Tensor,
        use_cache: bool,
        capacity: int,
        pad: int | None = None,
    ) -> None:
        self.model, self.memory, self.src_mask = model, memory, src_mask
        self.pad = model.cfg.pad_id if pad is None else pad
        self.cache: list[LayerCache] | None = model.new_cache(capacity) if use_cache else None

    def log_probs(self, tokens: Tensor) -> Tensor:
        """(N, t) prefixes → (N, V) log P(next token), in float32, with log P(<pad>) = −∞."""
        if self.cache is not None:  # the cache holds tokens[:, :-1] already
            logits = self.model.decode(tokens[:, -1:], self.memory, self.src_mask, cache=self.cache)
        else:
            logits = self.model.decode(tokens, self.memory, self.src_mask)
        log_probs = logits[:, -1].float().log_softmax(-1)
        # Not renormalised, as transformers' bad_words_ids does it: the other tokens keep their log P exactly.
        log_probs[:, self.pad] = -torch.inf
        return log_probs

    def log_probs_and_attention(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """log_probs, and the newest position's cross-attention in the last decoder layer, mean over heads (N, S)."""
        last = f"decoder.layers.{len(self.model.decoder.layers) - 1}.cross_attn"
        with record_attention(self.model, only=last) as recorder:  # only that layer leaves the fused kernel
            log_probs = self.log_probs(tokens)
        weights = recorder.weights_of(last)
        if not weights:
            raise QkvError("the coverage penalty needs a decoder with cross-attention")
        return log_probs, weights[-1][:, :, -1].float().mean(1)  # (N, H, t, S) → (N, S)

    def reorder(self, index: Tensor) -> None:
        """Keep prefixes `index` (N,), in that order (beam search reshuffles them every step)."""
        if self.cache is not None:
            # Only self-attention: `index` never leaves a sentence's block of beams, and the beams of one
            # sentence share the same memory, so the cross-attention K/V rows are already right.
            for layer in self.cache:
                layer.self_attn.reorder(index)


def _strip(tokens: Tensor, sp: Specials) -> list[list[int]]:
    """Token lists without <s> and without anything from the first </s> (or padding) on."""
    out = []
    for row in tokens[:, 1:].tolist():
        ends = [i for i, t in enumerate(row) if t in (sp.eos, sp.pad)]
        out.append(row[: ends[0]] if ends else row)
    return out


def limits(src: Tensor, sp: Specials, model: Transformer, max_len: int | None = None) -> list[int]:
    """Output tokens each source row of src (B, S) may produce: max_len, or its own_max_len (None)."""
    lengths = (src != sp.pad).sum(-1).tolist()
    return [own_max_len(n, model) if max_len is None else max_len for n in lengths]


@torch.no_grad()
@cpu_threads(1)  # a step multiplies tiny matrices (B × d_model): a second thread only waits (io.devices)
def greedy_decode(model: Transformer, src: Tensor, sp: Specials, max_len: int | None = None, use_cache: bool = True,
                  slots: int = 64) -> list[list[int]]:  # fmt: skip
    """The most likely next token at every step, for each source row of src (B, S) (padded with sp.pad).

    The sentences decode in qkv's engine (qkv.engine.rows.SourceRows), `slots` at a time, longest first: a sentence
    that ends frees its slot for the next. Each may produce `limits` tokens. use_cache=False re-reads every prefix
    of the padded batch instead (the tests' reference); a decoder with latent or sliding-window attention decodes
    batches of `slots` sentences in its own cache."""
    sources = [row[row != sp.pad].tolist() for row in src]
    allowed = limits(src, sp, model, max_len)
    # Longest first: sources that start together are of similar lengths (little padding), and no long one is left
    # to finish alone at the end.
    order = [i for i in sorted(range(len(sources)), key=lambda i: -len(sources[i])) if sources[i] and allowed[i]]
    out: list[list[int]] = [[] for _ in sources]
    if not order:
        return out
    if not use_cache or unslottable(model.new_cache(1)) is not None:  # a latent or sliding-window decoder
        for at in range(0, len(order), slots):
            batch = order[at : at + slots]
            decoded = _greedy_batch(model, src[batch], sp, [allowed[i] for i in batch], use_cache)
            for i, ids in zip(batch, decoded, strict=True):
                out[i] = ids
        return out
    rows = SourceRows(model, min(slots, len(order)), max(allowed) + 1, max(map(len, sources)), sp.bos, sp.pad)
    replies = Engine(model, rows=rows, max_queue=len(order)).generate(
        [Request(sources[i], allowed[i], GREEDY, frozenset({sp.eos})) for i in order]
    )
    for i, (tokens, _) in zip(order, replies, strict=True):
        out[i] = [t.id for t in tokens]
    return out


def _greedy_batch(model: Transformer, src: Tensor, sp: Specials, allowed: list[int], use_cache: bool,
                  ) -> list[list[int]]:  # fmt: skip
    """Greedy decoding of the padded batch src (B, S) as one batch, row b up to allowed[b] tokens, in the model's own
    cache or re-reading every prefix: the reference for the engine's, and the way for caches without slots."""
    src_mask = padding_mask_from_ids(src, sp.pad)  # (B, 1, 1, S)
    stepper = _Stepper(model, model.encode(src, src_mask), src_mask, use_cache, max(allowed) + 1, sp.pad)
    tokens = torch.full((src.shape[0], 1), sp.bos, dtype=torch.int64, device=src.device)  # (B, 1)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    last = torch.tensor(allowed, device=src.device)  # (B,)
    for step in range(max(allowed)):
        nxt = stepper.log_probs(tokens).argmax(-1)  # (B,)
        nxt = torch.where(done, torch.full_like(nxt, sp.pad), nxt)  # finished rows only pad
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        done |= (nxt == sp.eos) | (last <= step + 1)
        if bool(done.all()):
            break
    return _strip(tokens, sp)


def _extensions(logp: Tensor, scores: Tensor, lengths: Tensor, finished: Tensor,
                pad: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """log P (B, K, V) of every one-token extension of each hypothesis, and their lengths (B, K).

    A finished hypothesis has exactly one continuation, padding, at no cost, and its length stays.
    """
    frozen = torch.full_like(logp[0, 0], -torch.inf)
    frozen[pad] = 0.0
    logp = torch.where(finished[..., None], frozen, logp)
    return scores[..., None] + logp, lengths + (~finished).long()


@torch.no_grad()
@cpu_threads(1)  # a step multiplies tiny matrices (B × d_model): a second thread only waits (io.devices)
def beam_search(model: Transformer, src: Tensor, sp: Specials, beam_size: int = 4,
                length_penalty: float = LENGTH_PENALTY, max_len: int | None = None, use_cache: bool = True,
                coverage_penalty: float = 0.0) -> list[list[int]]:  # fmt: skip
    """The best of `beam_size` hypotheses per source row, ranked by log P / lp(α) + cp(β), GNMT's score.

    Every sentence keeps K hypotheses; each step extends all of them by every token and keeps the K
    best candidates by that score, each ranked as if it ended there. A finished hypothesis (it produced
    </s>) stays in the beam with its score frozen (it can only be extended by padding), so it competes
    with the live ones until a better one pushes it out. A sentence is done when all its K hypotheses
    are finished, the batch when every sentence is; a sentence's hypotheses are frozen after its `limits` tokens.
    K = 1 with β = 0 is exactly greedy decoding.
    """
    b, k, device = src.shape[0], beam_size, src.device
    src_mask = padding_mask_from_ids(src, sp.pad)  # (B, 1, 1, S)
    last = torch.tensor(limits(src, sp, model, max_len), device=device)[:, None]  # (B, 1)
    memory = model.encode(src, src_mask).repeat_interleave(k, dim=0)  # (B·K, S, d): beams of a sentence adjacent
    stepper = _Stepper(model, memory, src_mask.repeat_interleave(k, dim=0), use_cache, int(last.max()) + 1)
    tokens = torch.full((b * k, 1), sp.bos, dtype=torch.int64, device=device)  # (B·K, t)
    scores = torch.zeros(b, k, device=device)  # log P of each hypothesis
    scores[:, 1:] = -torch.inf  # all beams start identical: let only the first one expand at step 1
    lengths = torch.zeros(b, k, dtype=torch.int64, device=device)  # tokens generated, </s> included
    finished = torch.zeros(b, k, dtype=torch.bool, device=device)
    offsets = torch.arange(b, device=device)[:, None] * k  # (B, 1): first row of each sentence's block
    src_pad = (src == sp.pad)[:, None, :]  # (B, 1, S)
    coverage = torch.zeros(b, k, src.shape[1], device=device)  # attention each source token has received
    for step in range(int(last.max())):
        if coverage_penalty:
            step_logp, attn = stepper.log_probs_and_attention(tokens)  # (B·K, V), (B·K, S)
            # The attention read while choosing the next token counts towards that token, as in GNMT.
            coverage = coverage + attn.view(b, k, -1).masked_fill(finished[..., None], 0.0)
        else:
            step_logp = stepper.log_probs(tokens)
        candidates, new_lengths = _extensions(step_logp.view(b, k, -1), scores, lengths, finished, sp.pad)
        vocab = candidates.shape[-1]
        ranked = candidates / gnmt_length_penalty(new_lengths, length_penalty)[..., None]
        if coverage_penalty:
            ranked = ranked + gnmt_coverage_penalty(coverage, src_pad, coverage_penalty)[..., None]
        best = ranked.view(b, -1).topk(k, dim=-1).indices  # (B, K) into K·V
        beam, token = best // vocab, best % vocab  # which hypothesis each winner extends, and by what
        scores = candidates.view(b, -1).gather(1, best)
        lengths = new_lengths.gather(1, beam)
        if coverage_penalty:
            coverage = coverage.gather(1, beam[..., None].expand_as(coverage))
        finished = finished.gather(1, beam) | (token == sp.eos) | (last <= step + 1)
        rows = (offsets + beam).view(-1)  # (B·K,) rows of the previous step's prefixes
        tokens = torch.cat([tokens[rows], token.view(-1, 1)], dim=1)
        stepper.reorder(rows)
        if bool(finished.all()):
            break
    final = scores / gnmt_length_penalty(lengths, length_penalty)  # (B, K)
    final = final + (gnmt_coverage_penalty(coverage, src_pad, coverage_penalty) if coverage_penalty else 0.0)
    winners = (offsets.view(-1) + final.argmax(dim=-1)).view(-1)  # (B,)
    return _strip(tokens[winners], sp)
