"""Token-by-token generation: the model's softmax over the next token, sampled, fed back.

With the KV cache each step runs the model on the one new token and reuses every earlier
token's keys and values; without it each step re-runs the whole sequence. Both give the same
tokens (tests check it), the cache just avoids O(T²) recomputation.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

import torch
from torch import Tensor

from qkv.attention import LayerCache, cache_length, crop_cache
from qkv.errors import QkvError
from qkv.tokenizers import Tokenizer


class CausalLM(Protocol):
    """What generation needs from a model: logits for ids following a cache, and a fresh cache."""

    def __call__(self, ids: Tensor, cache: list[LayerCache] | None = None) -> Tensor: ...
    def new_cache(self, capacity: int = 256) -> list[LayerCache]: ...
    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to −inf every logit outside the top k, and outside the smallest set with mass ≥ top_p."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already hold top_p of the mass; the first always stays.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: temperature (0 = greedy), top-k, top-p, and a seed for repeatable draws."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None: PyTorch's global random generator

    def __post_init__(self) -> None:
        """Refuse options that make no sense, naming the option."""
        if not math.isfinite(self.temperature) or (self.top_p is not None and not math.isfinite(self.top_p)):
            raise QkvError(f"temperature and top_p must be finite numbers, got {self.temperature}, {self.top_p}")
        if self.temperature < 0:
            raise QkvError(f"temperature must be ≥ 0 (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise QkvError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature:g}")
        if self.top_k is not None and self.top_k < 1:
            raise QkvError(f"top_k must be ≥ 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise QkvError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A fresh generator seeded with `seed` on `device`, or None to use the global one."""
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


GREEDY = Sampling(temperature=0.0)
MIN_TEMPERATURE = 1e-3  # below it, logits / T overflows float32 for real logits: use 0, greedy


def next_token_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """The distribution the next token is drawn from (B, V): softmax(logits / T) after top-k and top-p.

    Temperature 0 puts all the mass on the argmax (greedy).
    """
    if sampling.temperature == 0.0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.softmax(logits, dim=-1)


def sample_next(logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> Tensor:
    """Next token ids (B,) from last-position logits (B, V); temperature 0 means greedy (argmax)."""
    if sampling.temperature == 0.0:
        return logits.float().argmax(dim=-1)  # on the CPU a cast and float32 argmax beat a bfloat16 argmax
    probs = next_token_probs(logits, sampling)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def stream(
    model: CausalLM,
    ids: Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    use_cache: bool = True,
    cache: list[LayerCache] | None = None,
    compiled: bool = False,
) -> Iterator[Tensor]:
    """Yield the next token ids (B,) step by step; rows that produced eos_id keep yielding eos_id.

    Sequences longer than the model's context (cfg.max_positions) are cropped to their last tokens,
    and the cache is rebuilt from that window, so cached and uncached runs stay identical.
    cache: a cache of the model's that already holds the keys and values of ids' first tokens (a conversation's
    earlier turns); generation reads only the rest of ids, and appends to it in place.
    compiled: one-token steps run compiled_step(model) (the prompt is read eagerly).
    Bad arguments raise QkvError here, at the call, not at the first next().
    """
    if max_new_tokens < 0:
        raise QkvError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise QkvError(f"the prompt must be a non-empty (B, T) tensor of ids, got shape {tuple(ids.shape)}")
    check_token_ids(ids, _model_setting(model, "vocab_size"))
    if cache_length(cache) >= ids.shape[1]:
        raise QkvError(f"the cache holds {cache_length(cache)} tokens of a {ids.shape[1]}-token prompt; it must "
                       "hold fewer, so that at least the prompt's last token is read")  # fmt: skip
    if compiled and not (use_cache and hasattr(model, "next_logits")):
        raise QkvError("a compiled decode step needs the KV cache and a qkv decoder-only model")
    if cache is None and use_cache:  # preallocated for the whole generation: it never regrows (and copies)
        limit = _model_setting(model, "max_positions") or 1 << 30
        cache = model.new_cache(min(limit, ids.shape[1] + max_new_tokens))
    return _stream(model, ids, max_new_tokens, sampling, eos_id, cache, compiled_step(model) if compiled else None)


class CompiledStep:
    """A model's one-token step (DecoderLM.next_logits) compiled by Inductor, dynamic in the cache's length, so that
    one compilation serves every step: its hundreds of small ops become a few kernels (docs/speed.md).

    Two things keep a step's own overhead small. On the CPU the compiled code calls its kernels from C++ (Inductor's
    cpp_wrapper) instead of from Python. And Dynamo does not check the model's modules at every call (those checks
    cost more than the step's own work outside its products): compiled_step compares them once per lookup
    (_signature) instead, and a changed model gets a step of its own, with compiled code of its own.
    """

    def __init__(self, model: CausalLM) -> None:
        options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if next(model.parameters()).device.type == "cpu":  # its glue built apart from the kernels, at -O1: minutes less
            options.update(cpp_wrapper=True, cpp_wrapper_build_separate=True)
        self.step = torch.compile(model.next_logits, dynamic=True, options=options,  # type: ignore[attr-defined, call-overload]
                                  isolate_recompiles=True)  # unguarded modules: never another model's code
        self.signature = _signature(model)
        self.compile_s: float | None = None  # how long the first call took (compiling, or reading Inductor's cache)

    def __call__(self, ids: Tensor, cache: list[LayerCache], padding_mask: Tensor | None = None,
                 positions: Tensor | None = None) -> Tensor:  # fmt: skip
        """Logits (B, V) after reading ids (B, 1) into the cache (a slot cache: with its mask and positions)."""
        if self.compile_s is None:
            begin = time.perf_counter()
            logits = self.step(ids, cache, padding_mask, positions)
            self.compile_s = time.perf_counter() - begin
            return logits
        return self.step(ids, cache, padding_mask, positions)


def _signature(model: CausalLM) -> tuple[Any, ...]:
    """What a compiled step depends on among the model's modules: their kinds, plain settings (mode, flags) and
    hooks, and their tensors' dtypes, shapes, strides and devices."""
    if not isinstance(model, torch.nn.Module):
        return ()
    modules = tuple((name, type(m), tuple(m._forward_hooks), tuple(m._forward_pre_hooks),
                     tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, bool | int | float | str))))
                    for name, m in model.named_modules())  # fmt: skip
    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = tuple((name, t.dtype, t.shape, t.stride(), t.device) for name, t in named)
    return modules, tensors


_COMPILED: weakref.WeakKeyDictionary[Any, CompiledStep] = weakref.WeakKeyDictionary()


def compiled_step(model: CausalLM) -> CompiledStep:
    """The model's compiled one-token step, made once per model and remade when its modules change (compilation is
    applied from outside the model)."""
    if model not in _COMPILED or _COMPILED[model].signature != _signature(model):
        _COMPILED[model] = CompiledStep(model)
    return _COMPILED[model]


# Prompt tokens read per forward pass: long prompts in bounded memory, each pass still batched; in the engine, also the
# longest pause a prompt imposes on the sequences decoding beside it.
PREFILL_CHUNK = 256


def _read(model: CausalLM, ids: Tensor, cache: list[LayerCache] | None) -> Tensor:
    """The next token's logits (B, V) after reading ids (B, T) into the cache: in chunks, un-embedding only the last
    position, where the model can (DecoderLM.next_logits)."""
    last = getattr(model, "next_logits", None)
    if cache is None or last is None:
        return model(ids, cache=cache)[:, -1]
    for start in range(0, ids.shape[1] - PREFILL_CHUNK, PREFILL_CHUNK):
        model.hidden(ids[:, start : start + PREFILL_CHUNK], cache)  # type: ignore[attr-defined]
    return last(ids[:, (ids.shape[1] - 1) // PREFILL_CHUNK * PREFILL_CHUNK :], cache)


@torch.inference_mode()  # like no_grad, minus autograd's version counters and view tracking
def _stream(
    model: CausalLM, ids: Tensor, max_new_tokens: int, sampling: Sampling, eos_id: int | None,
    cache: list[LayerCache] | None, step: CompiledStep | None = None,
) -> Iterator[Tensor]:  # fmt: skip
    """The generator behind stream (arguments already validated; cache None: none; step: a compiled one-token step)."""
    limit = _model_setting(model, "max_positions") or 1 << 30
    generator = sampling.generator(ids.device)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    seq = ids
    cached = cache_length(cache)  # tokens the cache holds
    next_input = ids[:, cached:] if cache is not None else ids[:, -limit:]
    for _ in range(max_new_tokens):
        if cache is not None and cached + next_input.shape[1] > limit:
            crop_cache(cache, 0)  # context full: re-read the last `limit` tokens
            cached, next_input = 0, seq[:, -limit:]
        if step is not None and cache is not None and next_input.shape[1] == 1:
            logits = step(next_input, cache)  # (B, V)
        else:
            logits = _read(model, next_input, cache)
        cached += next_input.shape[1]
        token = sample_next(logits, sampling, generator)
        if eos_id is not None:
            token = token.masked_fill(finished, eos_id)
            finished |= token == eos_id
        yield token
        seq = torch.cat([seq, token[:, None]], dim=1)
        next_input = token[:, None] if cache is not None else seq[:, -limit:]
        if eos_id is not None and bool(finished.all()):
            return


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many ids a and b share from their start: the tokens a cache of a can keep for b."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _model_setting(model: CausalLM, name: str) -> Any:
    """A qkv model's config setting (vocab_size, max_positions), or None for another model."""
    return getattr(getattr(model, "cfg", None), name, None)


def check_token_ids(ids: Tensor, vocab_size: int | None) -> None:
    """Refuse ids outside [0, vocab_size) in one line (ids a user gave: a model's forward does not check them)."""
    if vocab_size is not None and ids.numel() and bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise QkvError(f"token id out of range [0, {vocab_size}): got min {int(ids.min())}, max {int(ids.max())}")


@overload
def generate(model: CausalLM, prompt: str, max_new_tokens: int = 200, sampling: Sampling = ..., *,
             tokenizer: Tokenizer | None = None, eos_id: int | None = None, use_cache: bool = True) -> str: ...
@overload
def generate(model: CausalLM, prompt: Tensor, max_new_tokens: int = 200, sampling: Sampling = ..., *,
             tokenizer: Tokenizer | None = None, eos_id: int | None = None, use_cache: bool = True) -> Tensor: ...
def generate(
    model: CausalLM,
    prompt: str | Tensor,
    max_new_tokens: int = 200,
    sampling: Sampling = Sampling(),
    *,
    tokenizer: Tokenizer | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> str | Tensor:
    """The prompt's continuation: for text, the new text (the tokenizer's, up to its end-of-text token); for ids
    (B, T), the ids followed by up to max_new_tokens generated ones, (B, T + n)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise QkvError("generating from text needs the model's tokenizer: pass tokenizer=, or give token ids")
        eos = tokenizer.eos_id if eos_id is None else eos_id
        ids = tokenizer.encode_tensor(prompt)[None, :].to(next(model.parameters()).device)
        tokens = [int(t[0]) for t in stream(model, ids, max_new_tokens, sampling, eos, use_cache)]
        return tokenizer.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens)
    steps = list(stream(model, prompt, max_new_tokens, sampling, eos_id, use_cache))
    return torch.cat([prompt, torch.stack(steps, dim=1)], dim=1) if steps else prompt
