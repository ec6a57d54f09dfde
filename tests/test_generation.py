"""Tests for qkv.generation: cached and uncached generation agree, eos handling, filtering, bad options."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers import model_cfg
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from qkv import DecoderLM, DecoderLMConfig, QkvError
from qkv.attention import LayerCache, cache_length
from qkv.generation import Sampling, filter_logits, generate, next_token_probs, sample_next, stream


@functools.cache
def tiny_lm(
    positions: str = "learned", vocab: int = 13, n_kv_heads: int | None = None, sharpen: bool = True
) -> DecoderLM:
    """A small DecoderLM in eval mode; sharpened: large embeddings give peaked, well-separated logits."""
    torch.manual_seed(5)
    cfg = model_cfg(DecoderLMConfig, vocab_size=vocab, d_model=16, n_heads=4, n_kv_heads=n_kv_heads, n_layers=2,
                    max_positions=24, d_ff=32, positions=positions)  # fmt: skip
    model = DecoderLM(cfg).eval()
    if sharpen:
        with torch.no_grad():
            model.embed.tokens.weight.mul_(20)  # spread the logits so greedy choices are well separated
    return model


@pytest.mark.parametrize("positions,n_kv", [("learned", None), ("sinusoidal", None), ("rotary", 2)])
def test_greedy_is_identical_with_and_without_cache(positions: str, n_kv: int | None) -> None:
    """temperature=0 (argmax) gives the same tokens whether or not the KV cache is used."""
    model = tiny_lm(positions, n_kv_heads=n_kv)
    prompt = torch.randint(0, 13, (3, 4))
    cached = generate(model, prompt, 12, Sampling(temperature=0.0), use_cache=True)
    uncached = generate(model, prompt, 12, Sampling(temperature=0.0), use_cache=False)
    assert cached.shape == (3, 16)
    assert torch.equal(cached[:, :4], prompt)
    assert torch.equal(cached, uncached)
    # greedy really is argmax of the full forward at every step
    with torch.no_grad():
        logits = model(cached[:, :-1])
    assert torch.equal(logits[:, 3:].argmax(-1), cached[:, 4:])


@pytest.mark.parametrize("prompt_length", [4, 5, 9, 13])
def test_a_prompt_read_in_chunks_gives_the_logits_of_one_pass(prompt_length: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill reads the prompt in chunks of PREFILL_CHUNK tokens and un-embeds only its last position."""
    import qkv.generation

    monkeypatch.setattr(qkv.generation, "PREFILL_CHUNK", 4)
    model = tiny_lm("rotary", n_kv_heads=2)
    prompt = torch.randint(0, 13, (2, prompt_length))
    cache = model.new_cache(24)
    with torch.no_grad():
        chunked = qkv.generation._read(model, prompt, cache)
        whole = model(prompt)[:, -1]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    assert cache_length(cache) == prompt_length
    cached = generate(model, prompt, 8, Sampling(temperature=0.0))
    assert torch.equal(cached, generate(model, prompt, 8, Sampling(temperature=0.0), use_cache=False))


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.sampled_from([None, 1, 3]),
    top_p=st.sampled_from([None, 0.9, 0.5]),
    positions=st.sampled_from(["learned", "rotary"]),
)
def test_seeded_sampling_is_identical_with_and_without_cache(
    seed: int, temperature: float, top_k: int | None, top_p: float | None, positions: str
) -> None:
    """With the same generator seed, sampling gives the same tokens with use_cache=True and False."""
    model = tiny_lm(positions)
    prompt = torch.randint(0, 13, (2, 3), generator=torch.Generator().manual_seed(seed))
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    outs = [generate(model, prompt, 10, sampling, use_cache=use_cache) for use_cache in (True, False)]
    assert torch.equal(outs[0], outs[1])
    again = generate(model, prompt, 10, sampling)
    assert torch.equal(again, outs[0])  # seeded: reproducible


def test_generation_past_max_positions_crops_the_context_identically() -> None:
    """Beyond max_positions the window slides; cached and uncached runs still agree."""
    model = tiny_lm("learned")
    prompt = torch.randint(0, 13, (2, 20))
    cached = generate(model, prompt, 10, Sampling(temperature=0.0), use_cache=True)
    uncached = generate(model, prompt, 10, Sampling(temperature=0.0), use_cache=False)
    assert cached.shape == (2, 30)
    assert torch.equal(cached, uncached)
    with torch.no_grad():
        last = model(cached[:, -25:-1])[:, -1].argmax(-1)  # the last token saw only the last 24 tokens
    assert torch.equal(last, cached[:, -1])


@pytest.mark.parametrize("new_tokens", [3, 10])  # 10: the context (24) fills, and the caller's cache restarts
def test_a_cache_that_holds_the_prompts_start_reads_only_the_rest(new_tokens: int) -> None:
    """stream(cache=…) with the keys of the prompt's first 12 tokens: the tokens of a run from scratch, and the
    first forward pass reads the other 8 only."""
    model = tiny_lm("rotary", n_kv_heads=2)
    prompt = torch.randint(0, 13, (1, 20), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(8)
    with torch.no_grad():
        model(prompt[:, :12], cache=cache)
    reads: list[int] = []
    handle = model.embed.register_forward_pre_hook(lambda _, args: reads.append(args[0].shape[1]))  # ids (B, T)
    try:
        resumed = torch.stack(list(stream(model, prompt, new_tokens, Sampling(temperature=0.0), cache=cache)), 1)
    finally:
        handle.remove()
    fresh = generate(model, prompt, new_tokens, Sampling(temperature=0.0), use_cache=False)[:, 20:]
    assert torch.equal(resumed, fresh) and reads[0] == 8
    with pytest.raises(QkvError, match="the cache holds 20 tokens of a 20-token prompt"):
        stream(model, prompt, 1, cache=_held(model, 20))


def _held(model: DecoderLM, n: int) -> list[LayerCache]:
    """A cache of `model` holding n tokens."""
    cache = model.new_cache(n)
    with torch.no_grad():
        model(torch.zeros(1, n, dtype=torch.int64), cache=cache)
    return cache


@pytest.mark.parametrize("use_cache", [True, False])
def test_rows_that_emitted_eos_keep_emitting_eos(use_cache: bool) -> None:
    """Once a row samples eos it only emits eos; other rows continue unchanged; all-eos stops early."""
    model = tiny_lm("learned", vocab=4, sharpen=False)  # near-uniform over 4 tokens: eos comes early, and goes
    eos = 2
    prompt = torch.tensor([[0, 1], [1, 0], [3, 3], [0, 0], [1, 1], [3, 0]])
    plain = generate(model, prompt, 15, Sampling(temperature=2.0, seed=0))
    with_eos = generate(model, prompt, 15, Sampling(temperature=2.0, seed=0), eos_id=eos, use_cache=use_cache)
    new_plain, new_eos = plain[:, 2:], with_eos[:, 2:]
    n = new_eos.shape[1]
    assert 1 <= n <= 15
    is_eos = new_plain[:, :n] == eos
    assert is_eos.any(), "the test needs at least one row to emit eos"
    after_eos_plain = (is_eos.cumsum(dim=1) > 0) & ~is_eos
    assert after_eos_plain.any(), "the test needs a row that would emit something else after eos"
    after_first_eos = is_eos.cumsum(dim=1) > 0
    # the sampler's random stream is unaffected by eos: the run equals the plain run with eos forced after it
    expected = torch.where(after_first_eos, torch.full_like(new_plain[:, :n], eos), new_plain[:, :n])
    assert torch.equal(new_eos, expected)
    if n < 15:  # stopped early: every row has finished
        assert (new_eos[:, -1] == eos).all()
    else:
        assert not after_first_eos[:, -2].all()


def test_eos_stops_generation_when_every_row_is_done() -> None:
    """With greedy decoding and eos = the first greedy token of every row, one step is produced."""
    model = tiny_lm("learned")
    prompt = torch.tensor([[4, 5, 6]])
    first = int(generate(model, prompt, 1, Sampling(temperature=0.0))[0, -1])
    out = generate(model, prompt, 10, Sampling(temperature=0.0), eos_id=first)
    assert out.tolist() == [[4, 5, 6, first]]
    steps = list(stream(model, prompt, 10, Sampling(temperature=0.0), eos_id=first))
    assert len(steps) == 1


def test_zero_new_tokens_returns_the_prompt() -> None:
    """max_new_tokens=0 is allowed and returns the prompt unchanged."""
    model = tiny_lm("learned")
    prompt = torch.randint(0, 13, (2, 5))
    assert torch.equal(generate(model, prompt, 0), prompt)


def test_filter_logits_top_k_and_top_p() -> None:
    """top_k keeps the k largest; top_p keeps the smallest prefix whose mass reaches p."""
    probs = torch.tensor([[0.5, 0.05, 0.2, 0.25]])
    logits = probs.log()
    kept_k = filter_logits(logits, top_k=2)
    assert torch.isfinite(kept_k).tolist() == [[True, False, False, True]]
    kept_p = filter_logits(logits, top_p=0.7)  # 0.5 + 0.25 = 0.75 ≥ 0.7
    assert torch.isfinite(kept_p).tolist() == [[True, False, False, True]]
    kept_p2 = filter_logits(logits, top_p=0.76)  # needs 0.2 as well
    assert torch.isfinite(kept_p2).tolist() == [[True, False, True, True]]
    kept_small = filter_logits(logits, top_p=0.1)  # the top token always stays
    assert torch.isfinite(kept_small).tolist() == [[True, False, False, False]]
    assert torch.equal(filter_logits(logits, top_k=10, top_p=1.0), logits)
    assert torch.equal(kept_p[torch.isfinite(kept_p)], logits[torch.isfinite(kept_p)])


def test_sample_next() -> None:
    """temperature 0 is argmax; top_k=1 is argmax too; sampling follows the softmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    assert sample_next(logits, Sampling(temperature=0.0)).tolist() == [1, 0]
    assert sample_next(logits, Sampling(temperature=1.0, top_k=1)).tolist() == [1, 0]
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits[:1], Sampling(), gen) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=3).float() / 4000
    expected = torch.softmax(logits[0], -1)
    assert torch.allclose(freq, expected, atol=0.03)
    assert math.isclose(float(freq.sum()), 1.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_new_tokens": -1}, r"max_new_tokens must be ≥ 0, got -1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": -0.2}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -1.0}, r"temperature must be ≥ 0"),
        ({"top_k": 0}, r"top_k must be ≥ 1, got 0"),
    ],
)
def test_bad_generation_options(kwargs: dict, match: str) -> None:
    """Nonsensical sampling options raise QkvError naming the option."""
    model = tiny_lm("learned")
    max_new_tokens = kwargs.pop("max_new_tokens", 3)
    with pytest.raises(QkvError, match=match):
        generate(model, torch.zeros(1, 2, dtype=torch.long), max_new_tokens, Sampling(**kwargs))


def test_bad_prompt() -> None:
    """An empty or 1-D prompt is refused."""
    model = tiny_lm("learned")
    with pytest.raises(QkvError, match=r"the prompt must be a non-empty \(B, T\) tensor"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(QkvError, match=r"the prompt must be a non-empty \(B, T\) tensor"):
        generate(model, torch.zeros(3, dtype=torch.long), 3)


@pytest.mark.parametrize("temperature", [-1.0, 1e-40, 1e-4])
def test_temperatures_that_would_overflow_the_logits_are_refused(temperature: float) -> None:
    """Between 0 (greedy) and 0.001, logits / T overflows float32 for real logits: refused with a one-line error."""
    with pytest.raises(QkvError, match="temperature must be"):
        Sampling(temperature=temperature)
    logits = torch.tensor([[30.0, 29.0, -5.0]])
    probs = next_token_probs(logits, Sampling(temperature=1e-3))
    assert torch.isfinite(probs).all() and probs[0, 0] == 1.0


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_eager_tokens() -> None:
    """stream(compiled=True): one Inductor compilation, dynamic in the cache's length, serves every step (no
    recompiling as the cache grows), and its float32 tokens equal the eager ones."""
    import torch._dynamo

    from qkv.generation import compiled_step

    torch._dynamo.reset()
    model = tiny_lm("rotary", n_kv_heads=2)
    prompt = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(3))
    eager = torch.stack(list(stream(model, prompt, 12, Sampling(temperature=0.0))), 1)
    compiled = torch.stack(list(stream(model, prompt, 12, Sampling(temperature=0.0), compiled=True)), 1)
    assert torch.equal(compiled, eager)
    step = compiled_step(model)
    assert step.compile_s is not None and step.compile_s > 0
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = torch.stack(list(stream(model, prompt, 12, Sampling(temperature=0.0), compiled=True)), 1)
    assert torch.equal(again, eager) and torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    with pytest.raises(QkvError, match="a compiled decode step needs the KV cache"):
        stream(model, prompt, 2, use_cache=False, compiled=True)


@pytest.mark.slow
def test_a_quantised_models_compiled_step_is_one_graph_with_the_eager_tokens() -> None:
    """A group-quantised model (its head recomputing its top logits exactly) compiles without graph breaks and
    decodes the eager tokens; a model changed afterwards (a hook that moves the logits), and another model of another
    depth, get compiled code of their own (the step skips Dynamo's module guards), not the first model's."""
    import torch._dynamo

    from qkv.generation import compiled_step
    from qkv.quantization import GroupLinear, quantize_int4

    def quantised(n_layers: int) -> DecoderLM:
        torch.manual_seed(7)
        cfg = model_cfg(DecoderLMConfig, vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, n_layers=n_layers,
                        max_positions=32, d_ff=128, positions="rotary")  # fmt: skip
        return quantize_int4(DecoderLM(cfg).eval())

    def both(model: DecoderLM) -> tuple[Tensor, Tensor]:
        eager = torch.stack(list(stream(model, prompt, 10, Sampling(temperature=0.0))), 1)
        return eager, torch.stack(list(stream(model, prompt, 10, Sampling(temperature=0.0), compiled=True)), 1)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = quantised(2)
    assert isinstance(model.lm_head, GroupLinear) and model.lm_head.exact_top
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    eager, compiled = both(model)
    assert torch.equal(compiled, eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no break at the head's exact top
    step = compiled_step(model)
    assert compiled_step(model) is step
    bias = torch.zeros(64)
    bias[eager[0, 3]] = -1e4  # the hook forbids the 4th token: the tokens must change from there on
    model.lm_head.register_forward_hook(lambda _m, _i, out: out + bias)
    hooked, compiled = both(model)
    assert compiled_step(model) is not step and torch.equal(compiled, hooked) and not torch.equal(hooked, eager)
    deeper = quantised(3)  # no reset: its step must not reuse the 2-layer model's code
    eager, compiled = both(deeper)
    assert torch.equal(compiled, eager)
