"""Tests for qkv.attention.multi_head: parity with torch.nn.MultiheadAttention, grouped-query
attention, and properties of self-attention (permutation equivariance, causality)."""

from __future__ import annotations

import pytest
import torch
from helpers import with_weights
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from qkv import MultiHeadAttention, QkvError
from qkv.attention import (
    KVCache,
    causal_mask,
    padding_mask_from_lengths,
    sliding_window_mask,
)

MASK_KINDS = ("none", "padding", "arbitrary", "sliding", "combined")


# --------------------------------------------------------------------------------------------
# MultiHeadAttention vs torch.nn.MultiheadAttention
# --------------------------------------------------------------------------------------------


def mha_pair(d_model: int, n_heads: int, bias: bool) -> tuple[nn.MultiheadAttention, MultiHeadAttention]:
    """A torch MultiheadAttention and a qkv MultiHeadAttention holding the same weights."""
    ref = nn.MultiheadAttention(d_model, n_heads, bias=bias, batch_first=True).eval()
    if bias:  # torch zero-initialises the biases; make them count
        with torch.no_grad():
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    mha = MultiHeadAttention(d_model, n_heads, bias=bias).eval()
    with torch.no_grad():
        wq, wk, wv = ref.in_proj_weight.chunk(3)
        mha.q_proj.weight.copy_(wq)
        mha.k_proj.weight.copy_(wk)
        mha.v_proj.weight.copy_(wv)
        mha.out_proj.weight.copy_(ref.out_proj.weight)
        if bias:
            bq, bk, bv = ref.in_proj_bias.chunk(3)
            mha.q_proj.bias.copy_(bq)
            mha.k_proj.bias.copy_(bk)
            mha.v_proj.bias.copy_(bv)
            mha.out_proj.bias.copy_(ref.out_proj.bias)
    return ref, mha


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("d_model,n_heads", [(16, 4), (12, 3), (8, 1)])
def test_mha_matches_torch_with_key_padding_mask(d_model: int, n_heads: int, bias: bool) -> None:
    """Same output and head-averaged weights as torch, with torch's key_padding_mask (True = ignore)."""
    ref, mha = mha_pair(d_model, n_heads, bias)
    x = torch.randn(3, 6, d_model)
    key_padding = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1], [0, 1, 0, 0, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        expected, expected_w = ref(x, x, x, key_padding_mask=key_padding, need_weights=True)
        out, weights = with_weights(mha, x, mask=~key_padding[:, None, None, :])
    assert weights.shape == (3, n_heads, 6, 6)
    assert (out - expected).abs().max().item() <= 1e-5
    assert (weights.mean(1) - expected_w).abs().max().item() <= 1e-5
    assert (weights[2, :, :, 1] == 0).all()


@pytest.mark.parametrize("bias", [True, False])
def test_mha_matches_torch_with_causal_mask(bias: bool) -> None:
    """causal=True (and the explicit causal mask) equal torch with attn_mask True = not allowed."""
    ref, mha = mha_pair(16, 4, bias)
    x = torch.randn(2, 7, 16)
    not_allowed = torch.ones(7, 7, dtype=torch.bool).triu(1)
    with torch.no_grad():
        expected, expected_w = ref(x, x, x, attn_mask=not_allowed, need_weights=True)
        out, weights = with_weights(mha, x, causal=True)
        out_masked = mha(x, mask=causal_mask(7))
        out_fused = mha(x, causal=True)
    for o in (out, out_masked, out_fused):
        assert (o - expected).abs().max().item() <= 1e-5
    assert (weights.mean(1) - expected_w).abs().max().item() <= 1e-5


@pytest.mark.parametrize("t_q,t_k", [(3, 7), (5, 2)])
def test_mha_cross_attention_matches_torch(t_q: int, t_k: int) -> None:
    """Cross-attention (queries from x, keys/values from a context of another length) with padding."""
    ref, mha = mha_pair(16, 2, True)
    x = torch.randn(2, t_q, 16)
    ctx = torch.randn(2, t_k, 16)
    key_padding = torch.zeros(2, t_k, dtype=torch.bool)
    key_padding[1, -1] = True
    with torch.no_grad():
        expected, expected_w = ref(x, ctx, ctx, key_padding_mask=key_padding, need_weights=True)
        out, weights = with_weights(mha, x, context=ctx, mask=~key_padding[:, None, None, :])
        out_fused = mha(x, context=ctx, mask=~key_padding[:, None, None, :])
    assert weights.shape == (2, 2, t_q, t_k)
    assert (out - expected).abs().max().item() <= 1e-5
    assert (out_fused - expected).abs().max().item() <= 1e-5
    assert (weights.mean(1) - expected_w).abs().max().item() <= 1e-5


def test_gqa_with_all_kv_heads_equals_mha() -> None:
    """n_kv_heads = n_heads is plain multi-head attention: same weights, same output."""
    mha = MultiHeadAttention(16, 4).eval()
    gqa = MultiHeadAttention(16, 4, n_kv_heads=4).eval()
    gqa.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.allclose(gqa(x, causal=True), mha(x, causal=True), atol=1e-6)


def _repeat_kv_heads(weight: Tensor, n_kv: int, group: int) -> Tensor:
    """(n_kv·D, ...) → (n_kv·group·D, ...): each K/V head's rows repeated for its query-head group."""
    d_head = weight.shape[0] // n_kv
    return (
        weight.reshape(n_kv, d_head, *weight.shape[1:])
        .repeat_interleave(group, dim=0)
        .reshape(n_kv * group * d_head, *weight.shape[1:])
    )


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 1), (6, 3), (6, 2)])
def test_gqa_equals_mha_with_repeated_kv_heads(n_heads: int, n_kv_heads: int) -> None:
    """Grouped-query attention = MHA whose K/V projections are the kv heads repeated per group."""
    d_model = 4 * n_heads
    group = n_heads // n_kv_heads
    gqa = MultiHeadAttention(d_model, n_heads, n_kv_heads=n_kv_heads).eval()
    assert gqa.k_proj.weight.shape == (n_kv_heads * 4, d_model)
    mha = MultiHeadAttention(d_model, n_heads).eval()
    with torch.no_grad():
        for p in gqa.parameters():
            p.normal_(std=0.3)  # non-zero biases, moderate magnitudes
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(_repeat_kv_heads(src.weight, n_kv_heads, group))
            dst.bias.copy_(_repeat_kv_heads(src.bias, n_kv_heads, group))
    x = torch.randn(2, 5, d_model)
    mask = padding_mask_from_lengths([5, 3])
    with torch.no_grad():
        out_g, w_g = with_weights(gqa, x, mask=mask, causal=True)
        out_m, w_m = with_weights(mha, x, mask=mask, causal=True)
        ctx = torch.randn(2, 3, d_model)
        cross_g, cross_m = gqa(x, context=ctx), mha(x, context=ctx)
        # Without weights the fused path runs; GQA folds query groups onto shared K/V heads where no mask
        # row depends on the query (padding only, or one query) and repeats K/V where one does (causal).
        pad_g, pad_m = gqa(x, mask=mask), mha(x, mask=mask)
        causal_g, causal_m = gqa(x, mask=mask, causal=True), mha(x, mask=mask, causal=True)
        # A decode step: one query against a cache of the 4 earlier tokens' K/V (the fold's main use).
        cache_g, cache_m = KVCache(), KVCache()
        gqa(x[:, :-1], mask=mask[..., :-1], causal=True, cache=cache_g)
        mha(x[:, :-1], mask=mask[..., :-1], causal=True, cache=cache_m)
        last_g = gqa(x[:, -1:], mask=mask, causal=True, cache=cache_g)
        last_m = mha(x[:, -1:], mask=mask, causal=True, cache=cache_m)
    assert (out_g - out_m).abs().max().item() <= 1e-5
    assert (w_g - w_m).abs().max().item() <= 1e-6
    for got, want in ((cross_g, cross_m), (pad_g, pad_m), (causal_g, causal_m), (last_g, last_m)):
        assert (got - want).abs().max().item() <= 1e-5
    assert (causal_g - out_g).abs().max().item() <= 1e-5  # fused and reference paths agree
    assert (last_g - causal_g[:, -1:]).abs().max().item() <= 1e-5  # the cached step equals the full forward's row


# --------------------------------------------------------------------------------------------
# MultiHeadAttention properties
# --------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(2, 7),
    heads=st.sampled_from([(8, 1), (8, 2), (12, 4), (12, 3)]),
    n_kv_div=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_self_attention_is_permutation_equivariant(t: int, heads: tuple[int, int], n_kv_div: int, seed: int) -> None:
    """Without positions or masks, permuting the tokens permutes the outputs the same way."""
    d_model, n_heads = heads
    n_kv = n_heads // n_kv_div if n_heads % n_kv_div == 0 else n_heads
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, n_heads, n_kv_heads=n_kv).eval()
    x = torch.randn(2, t, d_model)
    perm = torch.randperm(t)
    with torch.no_grad():
        out = mha(x)
        out_perm = mha(x[:, perm])
        _, w = with_weights(mha, x)
        _, w_perm = with_weights(mha, x[:, perm])
    assert (out_perm - out[:, perm]).abs().max().item() <= 1e-5
    assert (w_perm - w[:, :, perm][:, :, :, perm]).abs().max().item() <= 1e-5


@settings(max_examples=25, deadline=None)
@given(t=st.integers(2, 8), data=st.data(), seed=st.integers(0, 2**16), n_kv=st.sampled_from([1, 2, 4]))
def test_causal_self_attention_ignores_the_future(t: int, data: st.DataObject, seed: int, n_kv: int) -> None:
    """With causal=True, outputs up to position p do not change when tokens after p change."""
    p = data.draw(st.integers(0, t - 2))
    torch.manual_seed(seed)
    mha = MultiHeadAttention(16, 4, n_kv_heads=n_kv).eval()
    x = torch.randn(2, t, 16)
    y = x.clone()
    y[:, p + 1 :] = torch.randn(2, t - p - 1, 16) * 3
    with torch.no_grad():
        for backend_weights in (False, True):
            if backend_weights:
                out_x, _ = with_weights(mha, x, causal=True)
                out_y, _ = with_weights(mha, y, causal=True)
            else:
                out_x, out_y = mha(x, causal=True), mha(y, causal=True)
            assert (out_x[:, : p + 1] - out_y[:, : p + 1]).abs().max().item() <= 1e-6
            assert (out_x[:, p + 1 :] - out_y[:, p + 1 :]).abs().max().item() > 1e-4  # the future did change


def test_mha_weights_rows_sum_to_one_with_padding() -> None:
    """MHA's returned weights are a distribution over the real keys."""
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        _, w = with_weights(mha, x, mask=padding_mask_from_lengths([5, 2]))
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 5), atol=1e-6)
    assert (w[1, :, :, 2:] == 0).all()


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape).to(dtype)


def test_mha_bad_inputs() -> None:
    """MultiHeadAttention refuses bad head counts and inputs of the wrong width, by name."""
    with pytest.raises(QkvError, match=r"n_heads=3 must divide d_model=16"):
        MultiHeadAttention(16, 3)
    with pytest.raises(QkvError, match=r"n_kv_heads=3 must divide n_heads=4"):
        MultiHeadAttention(16, 4, n_kv_heads=3)
    with pytest.raises(QkvError, match=r"dropout must be in \[0, 1\)"):
        MultiHeadAttention(16, 4, dropout=-0.1)
    mha = MultiHeadAttention(16, 4)
    with pytest.raises(QkvError, match=r"attention input must be \(B, T, d_model=16\), got \(2, 3, 12\)"):
        mha(torch.randn(2, 3, 12))
    with pytest.raises(QkvError, match=r"attention input must be"):
        mha(torch.randn(3, 16))
    with pytest.raises(QkvError, match=r"context must be \(B=2"):
        mha(torch.randn(2, 3, 16), context=torch.randn(3, 4, 16))
    with pytest.raises(QkvError, match=r"mask must broadcast to \(B, H, T_q, T_k\)"):
        mha(torch.randn(2, 3, 16), mask=torch.ones(1, 2, 1, 1, 3, dtype=torch.bool))
    with pytest.raises(QkvError, match=r"mask of shape"):
        mha(torch.randn(2, 3, 16), mask=torch.ones(2, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(QkvError, match=r"sliding window must be at least 1"):
        sliding_window_mask(3, 0)
    with pytest.raises(QkvError, match=r"lengths must be non-negative"):
        padding_mask_from_lengths([2, -1])
    with pytest.raises(QkvError, match=r"a length exceeds max_len=2"):
        padding_mask_from_lengths([3], max_len=2)
