"""Tests for qkv.attention.sliding_window: windowed attention equals dense attention under an explicit window mask
(float64), the window cache gives the uncached numbers while holding W positions, and a run trains with it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import run_main
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import (
    MultiHeadAttention,
    SlidingWindowAttention,
    SlidingWindowAttentionConfig,
    WindowKVCache,
    cache_length,
    crop_cache,
    sliding_window_mask,
)
from qkv.errors import QkvError
from qkv.generation import GREEDY, generate
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.positional import RotaryEmbedding


def _pair(window: int, n_heads: int = 4, n_kv_heads: int = 2) -> tuple[SlidingWindowAttention, MultiHeadAttention]:
    """A windowed module and a dense one with the same weights, in float64."""
    torch.manual_seed(0)
    sliding = SlidingWindowAttention(32, n_heads, window, n_kv_heads).double().eval()
    dense = MultiHeadAttention(32, n_heads, n_kv_heads).double().eval()
    dense.load_state_dict(sliding.state_dict())
    return sliding, dense


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 20), window=st.integers(1, 24), backend_reference=st.booleans())
def test_causal_window_equals_dense_attention_under_the_window_mask(t: int, window: int,
                                                                    backend_reference: bool) -> None:  # fmt: skip
    """Query i attends to keys i − W + 1 … i: the dense module with sliding_window_mask gives the same output."""
    sliding, dense = _pair(window)
    x = torch.randn(2, t, 32, dtype=torch.float64)
    cos, sin = RotaryEmbedding(8, 64)(t)
    rope = (cos.double(), sin.double())
    if backend_reference:  # recording forces the formula; without it the fused kernel runs
        from qkv.attention import record_attention

        with record_attention() as rec:
            out = sliding(x, causal=True, rope=rope)
        (weights,) = rec.weights_of()
        assert not weights[..., ~sliding_window_mask(t, window)].any()  # nothing outside the window
    else:
        out = sliding(x, causal=True, rope=rope)
    expected = dense(x, mask=sliding_window_mask(t, window), rope=rope)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_a_window_as_long_as_the_text_is_causal_attention_and_a_window_of_one_sees_itself() -> None:
    """W ≥ T is plain causal attention; W = 1 gives each token its own value (through W_O)."""
    sliding, dense = _pair(window=16)
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    torch.testing.assert_close(sliding(x, causal=True), dense(x, causal=True), rtol=0, atol=1e-12)
    own, _ = _pair(window=1, n_kv_heads=4)
    alone = torch.cat([own(x[:, i : i + 1], causal=True) for i in range(16)], dim=1)  # each token by itself
    torch.testing.assert_close(own(x, causal=True), alone, rtol=0, atol=1e-12)


def test_bidirectional_window_sees_w_minus_one_on_either_side() -> None:
    """Without causality (an encoder), query i sees keys j with |i − j| < W, and a padding mask still applies."""
    sliding, dense = _pair(window=3)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    pos = torch.arange(9)
    band = (pos[None, :] - pos[:, None]).abs() < 3  # (T, T)
    padding = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    padding[1, ..., 7:] = False
    torch.testing.assert_close(sliding(x, mask=padding), dense(x, mask=band & padding), rtol=0, atol=1e-12)


def _windowed_lm(window: int = 4, global_every: int = 2, n_layers: int = 3) -> DecoderLM:
    """A float64 rotary, grouped-query language model with windowed layers (every second one global)."""
    torch.manual_seed(1)
    cfg = DecoderLMConfig.of(vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, n_layers=n_layers, positions="rotary",
                             max_positions=64, dropout=0.0, attention="sliding",
                             **{"attention.window": window, "attention.global_every": global_every})  # fmt: skip
    return cfg.build().double().eval()


def test_global_every_k_makes_every_kth_layer_dense() -> None:
    """Layers k−1, 2k−1, … are dense MultiHeadAttention (with a growing cache); the rest are windowed."""
    model = _windowed_lm(global_every=2, n_layers=5)
    kinds = [type(layer.self_attn).__name__ for layer in model.decoder.layers]
    assert kinds == ["SlidingWindowAttention", "MultiHeadAttention"] * 2 + ["SlidingWindowAttention"]
    cache = model.new_cache()
    assert [type(c.self_attn).__name__ for c in cache] == ["WindowKVCache", "KVCache"] * 2 + ["WindowKVCache"]
    assert [layer.self_attn.window for layer in model.decoder.layers[::2]] == [4, 4, 4]


@pytest.mark.parametrize("chunks", [[1] * 20, [7, 1, 1, 5, 6], [20]])
def test_cached_decoding_equals_the_full_pass_and_the_cache_holds_the_window(chunks: list[int]) -> None:
    """Reading 20 tokens in chunks through the cache gives the full pass's logits (float64, window 4 < 20)."""
    model = _windowed_lm()
    ids = torch.randint(0, 40, (2, 20))
    full = model(ids)
    cache, logits, start = model.new_cache(), [], 0
    for n in chunks:
        logits.append(model(ids[:, start : start + n], cache=cache))
        start += n
        assert cache_length(cache) == start
        assert cache[0].self_attn.keys_values()[0].shape[-2] == min(start, 4)  # the window, never more
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=0, atol=1e-10)


def test_a_left_padded_batch_decodes_through_the_window_cache() -> None:
    """A (B, T_past + T) padding mask keeps its columns for the keys the window still holds."""
    model = _windowed_lm()
    ids = torch.randint(0, 40, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :3] = False  # row 1 is left-padded
    full = model(ids, padding_mask=padding)
    cache = model.new_cache()
    first = model(ids[:, :8], cache=cache, padding_mask=padding[:, :8])
    rest = [model(ids[:, i : i + 1], cache=cache, padding_mask=padding[:, : i + 1]) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1)[:, 3:], full[:, 3:], rtol=0, atol=1e-10)


def test_cached_and_uncached_generation_are_identical() -> None:
    """Greedy generation 30 tokens past a window of 4: the cache changes nothing but the cost."""
    model = _windowed_lm()
    prompt = torch.randint(0, 40, (1, 6))
    cached = generate(model, prompt, 30, GREEDY, use_cache=True)
    uncached = generate(model, prompt, 30, GREEDY, use_cache=False)
    assert torch.equal(cached, uncached) and cached.shape == (1, 36)


def test_cropping_goes_back_while_the_window_is_held_and_empties_otherwise() -> None:
    """crop(L) keeps the window that ends at L when it is still held; else the cache empties (callers re-read)."""
    model = _windowed_lm(global_every=0)
    ids = torch.randint(0, 40, (1, 14))
    cache = model.new_cache()
    model(ids[:, :10], cache=cache)
    model(ids[:, 10:11], cache=cache)  # holds positions 7 … 10
    crop_cache(cache, 10)  # the next query (position 10) sees 7 … 10: still held
    assert cache_length(cache) == 10
    again = model(ids[:, 10:], cache=cache)
    torch.testing.assert_close(again, model(ids)[:, 10:], rtol=0, atol=1e-10)
    crop_cache(cache, 5)  # positions 2 … 4 are long gone
    assert cache_length(cache) == 0 and cache[0].self_attn.nbytes() == 0


def test_the_window_cache_refuses_cross_attention_and_counts_its_bytes() -> None:
    """A window cache serves self-attention; its memory is W positions whatever the length."""
    cache = WindowKVCache(3)
    for _ in range(10):
        cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert cache.length == 10 and cache.nbytes() == 2 * (1 * 2 * 3 * 4) * 4
    with pytest.raises(QkvError, match="serves self-attention"):
        cache.set(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))


def test_config_checks_and_round_trip() -> None:
    """Bad windows are refused in one line; the config stores and reads back as kind 'sliding'."""
    with pytest.raises(QkvError, match="window must be a positive integer, got 0"):
        SlidingWindowAttentionConfig(window=0)
    with pytest.raises(QkvError, match="global_every must be ≥ 0"):
        SlidingWindowAttentionConfig(global_every=-1)
    cfg = _windowed_lm().cfg
    stored = cfg.to_dict()
    assert stored["decoder"]["block"]["attention"]["kind"] == "sliding"
    assert type(cfg).from_dict(json.loads(json.dumps(stored))) == cfg


def test_qkv_train_with_a_sliding_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qkv train --model attention=sliding …` trains; the run generates the same text with and without a cache."""
    run = tmp_path / "run"
    code, out, err = run_main(capsys, "train", "--model", "attention=sliding", "--model", "attention.window=8",
                              "--model", "attention.global_every=2", "--n-layers", "2", "--d-model", "32", "--n-heads",
                              "2", "--block-size", "32", "--batch-size", "4", "--max-steps", "4", "--eval-interval",
                              "2", "--eval-tokens", "2000", "--sample-tokens", "0", "--device", "cpu", "--out-dir",
                              str(run))  # fmt: skip
    assert code == 0, err
    assert re.search(r"step +4  train [0-9.]+  val [0-9.]+", out + err)
    stored = json.loads((run / "config.json").read_text())["model"]["decoder"]["block"]["attention"]
    assert (stored["kind"], stored["window"], stored["global_every"]) == ("sliding", 8, 2)
    from qkv.tasks import load

    model = load(run).model
    assert [type(layer.self_attn).__name__ for layer in model.decoder.layers] == ["SlidingWindowAttention",
                                                                                 "MultiHeadAttention"]  # fmt: skip
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 5))
    assert torch.equal(generate(model, prompt, 40, GREEDY), generate(model, prompt, 40, GREEDY, use_cache=False))
