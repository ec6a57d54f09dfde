"""Tests for qkv.attention: scaled dot-product attention (both paths), masks, multi-head and
grouped-query attention (parity with torch.nn.MultiheadAttention), and the KV cache.

The attention reference used here is written from the formula, softmax(q kᵀ · scale) v, with
explicit loops over rows and its own masking; it shares no code with qkv.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from qkv import MultiHeadAttention, QkvError, scaled_dot_product_attention
from qkv.attention import (
    KVCache,
    LayerCache,
    cache_length,
    causal_mask,
    combine_masks,
    new_cache,
    padding_mask_from_ids,
    padding_mask_from_lengths,
    reorder_cache,
    sliding_window_mask,
)
from qkv.attention.sdpa import Backend
from qkv.positional import RotaryEmbedding

MASK_KINDS = ("none", "padding", "arbitrary", "sliding", "combined")


# --------------------------------------------------------------------------------------------
# An independent float64 attention, written from the formula
# --------------------------------------------------------------------------------------------


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale) v row by row in float64; a row with no visible key gives zeros.

    allowed: boolean, broadcastable to (..., T_q, T_k), True = may attend.
    causal: query i sees key j only if j ≤ i + T_k − T_q.
    Returns (output (..., T_q, d_v), weights (..., T_q, T_k)).
    """
    q, k, v = q.double(), k.double(), v.double()
    t_q, d_k = q.shape[-2:]
    t_k, d_v = v.shape[-2:]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if allowed is not None:
        lead = torch.broadcast_shapes(lead, allowed.shape[:-2])
    n = math.prod(lead)
    qf = q.expand(*lead, t_q, d_k).reshape(n, t_q, d_k)
    kf = k.expand(*lead, t_k, d_k).reshape(n, t_k, d_k)
    vf = v.expand(*lead, t_k, d_v).reshape(n, t_k, d_v)
    if allowed is None:
        allowed_f = torch.ones(n, t_q, t_k, dtype=torch.bool)
    else:
        allowed_f = allowed.expand(*lead, t_q, t_k).reshape(n, t_q, t_k)
    s = d_k**-0.5 if scale is None else scale
    out = torch.zeros(n, t_q, d_v, dtype=torch.float64)
    weights = torch.zeros(n, t_q, t_k, dtype=torch.float64)
    for b in range(n):
        for i in range(t_q):
            visible = [j for j in range(t_k) if bool(allowed_f[b, i, j]) and (not causal or j <= i + t_k - t_q)]
            if not visible:
                continue  # a query with nothing to attend to outputs zeros
            scores = [s * float(torch.einsum("d,d->", qf[b, i], kf[b, j])) for j in visible]
            top = max(scores)
            exps = [math.exp(x - top) for x in scores]
            total = sum(exps)
            for j, e in zip(visible, exps, strict=True):
                weights[b, i, j] = e / total
                out[b, i] += (e / total) * vf[b, j]
    return out.reshape(*lead, t_q, d_v), weights.reshape(*lead, t_q, t_k)


def my_sliding_window(t_q: int, t_k: int, window: int) -> Tensor:
    """(T_q, T_k): query i (absolute position i + T_k − T_q) sees keys in (pos − window, pos]."""
    m = torch.zeros(t_q, t_k, dtype=torch.bool)
    for i in range(t_q):
        pos = i + t_k - t_q
        for j in range(t_k):
            m[i, j] = pos - window < j <= pos
    return m


def my_padding(lengths: list[int], t_k: int) -> Tensor:
    """(B, 1, 1, T_k): True on the first lengths[b] keys."""
    m = torch.zeros(len(lengths), 1, 1, t_k, dtype=torch.bool)
    for b, n in enumerate(lengths):
        m[b, 0, 0, :n] = True
    return m


@st.composite
def attention_case(draw: st.DrawFn) -> dict:
    """Random shapes, mask kind, causal flag and scale for one attention call."""
    kind = draw(st.sampled_from(MASK_KINDS))
    t_q = draw(st.integers(1, 5))
    t_k = draw(st.integers(1, 6))
    d_k = draw(st.integers(1, 5))
    d_v = draw(st.integers(1, 5))
    n_seqs = draw(st.integers(1, 3))  # B of a (B, 1, 1, T_k) padding mask
    if kind in ("padding", "combined"):
        # q usually has the mask's batch dim, but may also lack it: the mask then broadcasts the output
        h = draw(st.integers(1, 3))
        lead = draw(st.sampled_from([[n_seqs, h], [1, h], [h], []]))
    else:
        lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
    # k and v may broadcast over some leading dims (e.g. one head of keys shared by all query heads)
    kv_lead = [1 if draw(st.booleans()) else n for n in lead]
    causal = draw(st.booleans())
    scale = draw(st.sampled_from([None, 1.0, 0.37]))
    lengths = [draw(st.integers(0, t_k)) for _ in range(n_seqs)]
    window = draw(st.integers(1, t_k + 1))
    seed = draw(st.integers(0, 2**16))
    return dict(
        kind=kind, t_q=t_q, t_k=t_k, d_k=d_k, d_v=d_v, lead=lead, kv_lead=kv_lead, causal=causal,
        scale=scale, lengths=lengths, window=window, seed=seed,
    )  # fmt: skip


def build_masks(case: dict, gen: torch.Generator) -> tuple[Tensor | None, Tensor | None]:
    """(mask for qkv, the same mask built independently for the reference)."""
    t_q, t_k, kind = case["t_q"], case["t_k"], case["kind"]
    if kind == "none":
        return None, None
    if kind == "padding":
        m = padding_mask_from_lengths(case["lengths"], max_len=t_k)
        return m, my_padding(case["lengths"], t_k)
    if kind == "arbitrary":
        m = torch.rand(t_q, t_k, generator=gen) < 0.6
        return m, m.clone()
    if kind == "sliding":
        return sliding_window_mask(t_q, case["window"], t_k), my_sliding_window(t_q, t_k, case["window"])
    arbitrary = torch.rand(t_q, t_k, generator=gen) < 0.8
    qkv_mask = combine_masks(
        padding_mask_from_lengths(case["lengths"], max_len=t_k), None, arbitrary,
        sliding_window_mask(t_q, case["window"], t_k),
    )  # fmt: skip
    ref_mask = my_padding(case["lengths"], t_k) & arbitrary & my_sliding_window(t_q, t_k, case["window"])
    return qkv_mask, ref_mask


def make_qkv(case: dict, dtype: torch.dtype, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Random q, k, v for a case."""
    q = torch.randn(*case["lead"], case["t_q"], case["d_k"], generator=gen, dtype=dtype)
    k = torch.randn(*case["kv_lead"], case["t_k"], case["d_k"], generator=gen, dtype=dtype)
    v = torch.randn(*case["kv_lead"], case["t_k"], case["d_v"], generator=gen, dtype=dtype)
    return q, k, v


# --------------------------------------------------------------------------------------------
# scaled_dot_product_attention vs the independent reference
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(case=attention_case())
def test_both_paths_match_independent_float64_reference(case: dict) -> None:
    """Reference path (with weights), reference path (no weights) and fused path all equal the formula."""
    gen = torch.Generator().manual_seed(case["seed"])
    q, k, v = make_qkv(case, torch.float64, gen)
    mask, ref_mask = build_masks(case, gen)
    expected, expected_w = reference_attention(q, k, v, ref_mask, case["causal"], case["scale"])
    kw = dict(mask=mask, causal=case["causal"], scale=case["scale"])

    out_ref, weights = scaled_dot_product_attention(q, k, v, **kw, return_weights=True)
    out_ref_nw = scaled_dot_product_attention(q, k, v, **kw, backend="reference")
    out_fused = scaled_dot_product_attention(q, k, v, **kw)
    out_fused_explicit = scaled_dot_product_attention(q, k, v, **kw, backend="fused")

    assert out_ref.shape == expected.shape
    assert weights.shape == expected_w.shape
    for out in (out_ref, out_ref_nw, out_fused, out_fused_explicit):
        assert out.dtype == torch.float64
        assert (out - expected).abs().max().item() <= 1e-6
    assert (weights - expected_w).abs().max().item() <= 1e-6


@pytest.mark.parametrize("t_q,t_k", [(1, 5), (2, 5), (3, 7), (4, 4)])
def test_causal_is_end_aligned(t_q: int, t_k: int) -> None:
    """With T_k ≥ T_q, query i sees exactly keys j ≤ i + T_k − T_q (the KV-cache layout)."""
    q = torch.randn(2, t_q, 3, dtype=torch.float64)
    k = torch.randn(2, t_k, 3, dtype=torch.float64)
    v = torch.randn(2, t_k, 4, dtype=torch.float64)
    _, weights = scaled_dot_product_attention(q, k, v, causal=True, return_weights=True)
    for i in range(t_q):
        for j in range(t_k):
            if j <= i + t_k - t_q:
                assert (weights[:, i, j] > 0).all()
            else:
                assert (weights[:, i, j] == 0).all()
    expected, _ = reference_attention(q, k, v, None, True, None)
    for backend in ("reference", "fused"):
        out = scaled_dot_product_attention(q, k, v, causal=True, backend=backend)
        assert (out - expected).abs().max().item() <= 1e-6
    # the helper mask is the same triangle
    assert torch.equal(causal_mask(t_q, t_k), weights[0] > 0)


def test_scale_one_is_unscaled_dot_product() -> None:
    """scale=1.0 uses q·k itself, the default divides by √d_k."""
    q = torch.randn(1, 3, 8, dtype=torch.float64)
    k = torch.randn(1, 4, 8, dtype=torch.float64)
    v = torch.randn(1, 4, 2, dtype=torch.float64)
    _, w1 = scaled_dot_product_attention(q, k, v, scale=1.0, return_weights=True)
    _, wd = scaled_dot_product_attention(q, k, v, return_weights=True)
    scores = torch.einsum("bid,bjd->bij", q, k)
    assert torch.allclose(w1, torch.softmax(scores, -1), atol=1e-12)
    assert torch.allclose(wd, torch.softmax(scores / math.sqrt(8), -1), atol=1e-12)
    assert not torch.allclose(w1, wd)
    for backend in ("reference", "fused"):
        out = scaled_dot_product_attention(q, k, v, scale=1.0, backend=backend)
        assert torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(case=attention_case())
def test_fused_matches_reference_in_fp32(case: dict) -> None:
    """The two paths agree to 1e-5 in float32 on every mask kind."""
    gen = torch.Generator().manual_seed(case["seed"])
    q, k, v = make_qkv(case, torch.float32, gen)
    mask, _ = build_masks(case, gen)
    kw = dict(mask=mask, causal=case["causal"], scale=case["scale"])
    ref = scaled_dot_product_attention(q, k, v, **kw, backend="reference")
    fused = scaled_dot_product_attention(q, k, v, **kw, backend="fused")
    assert ref.dtype == fused.dtype == torch.float32
    assert (ref - fused).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64_with_mask(backend: Backend, causal: bool) -> None:
    """Analytic gradients of q, k, v equal finite differences, with a padding mask."""
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = padding_mask_from_lengths([5, 3], max_len=5) & (torch.rand(3, 5) < 0.9)
    mask[..., 0, -1] = True  # every row keeps a visible key whatever the random draw

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return scaled_dot_product_attention(q, k, v, mask=mask, causal=causal, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "fused", "weights"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(backend: str) -> None:
    """A query that may attend to no key outputs 0 and sends no NaN back to q, k or v."""
    q = torch.randn(2, 2, 4, 3, dtype=torch.float32, requires_grad=True)
    k = torch.randn(2, 2, 5, 3, dtype=torch.float32, requires_grad=True)
    v = torch.randn(2, 2, 5, 6, dtype=torch.float32, requires_grad=True)
    arbitrary = torch.ones(4, 5, dtype=torch.bool)
    arbitrary[1] = False  # query 1 sees nothing in every sequence
    mask = padding_mask_from_lengths([5, 0], max_len=5) & arbitrary  # sequence 1 has no real keys
    if backend == "weights":
        out, weights = scaled_dot_product_attention(q, k, v, mask=mask, return_weights=True)
        assert not torch.isnan(weights).any()
        assert (weights[:, :, 1] == 0).all() and (weights[1] == 0).all()
        assert torch.allclose(weights[0, :, [0, 2, 3]].sum(-1), torch.ones(2, 3))
    else:
        out = scaled_dot_product_attention(q, k, v, mask=mask, backend="fused" if backend == "fused" else "reference")
    assert not torch.isnan(out).any()
    assert (out[:, :, 1] == 0).all()
    assert (out[1] == 0).all()
    assert (out[0, :, 0].abs().sum() > 0).item()
    (out * torch.randn_like(out)).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None
        assert torch.isfinite(t.grad).all()
        assert (t.grad[1] == 0).all()  # sequence 1 has no visible key: no gradient at all
    assert q.grad is not None and (q.grad[:, :, 1] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_causal_with_more_queries_than_keys_masks_leading_rows(backend: Backend) -> None:
    """T_q > T_k with causal: the first T_q − T_k queries see no key and output zeros, not NaN."""
    q = torch.randn(1, 5, 3, requires_grad=True)
    k = torch.randn(1, 3, 3, requires_grad=True)
    v = torch.randn(1, 3, 2, requires_grad=True)
    out = scaled_dot_product_attention(q, k, v, causal=True, backend=backend)
    assert (out[:, :2] == 0).all()
    expected, _ = reference_attention(q.detach(), k.detach(), v.detach(), None, True, None)
    assert (out.double() - expected).abs().max().item() <= 1e-5
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None)
@given(case=attention_case())
def test_attention_weight_rows_sum_to_one(case: dict) -> None:
    """Every query with a visible key distributes exactly unit mass over the keys; masked keys get 0."""
    gen = torch.Generator().manual_seed(case["seed"])
    q, k, v = make_qkv(case, torch.float64, gen)
    mask, ref_mask = build_masks(case, gen)
    _, weights = scaled_dot_product_attention(
        q, k, v, mask=mask, causal=case["causal"], scale=case["scale"], return_weights=True
    )
    assert (weights >= 0).all()
    sums = weights.sum(-1)
    _, ref_w = reference_attention(q, k, v, ref_mask, case["causal"], case["scale"])
    has_key = ref_w.sum(-1) > 0.5
    assert torch.allclose(sums[has_key], torch.ones_like(sums[has_key]), atol=1e-12)
    assert (sums[~has_key] == 0).all()
    assert (weights[ref_w == 0] == 0).all()


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def test_mask_helpers() -> None:
    """Shapes and contents of the mask helpers, checked against hand-written masks."""
    assert torch.equal(causal_mask(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(2, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    for t_q, t_k, w in [(4, 4, 2), (2, 6, 3), (5, 5, 1), (3, 3, 10)]:
        assert torch.equal(sliding_window_mask(t_q, w, t_k), my_sliding_window(t_q, t_k, w))
    assert torch.equal(sliding_window_mask(4, 4), causal_mask(4))
    lengths = [3, 0, 5]
    assert torch.equal(padding_mask_from_lengths(lengths, max_len=5), my_padding(lengths, 5))
    assert padding_mask_from_lengths(torch.tensor([2, 4])).shape == (2, 1, 1, 4)
    ids = torch.tensor([[5, 6, 0, 0], [1, 0, 2, 0]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)[:, None, None, :]
    assert torch.equal(padding_mask_from_ids(ids, pad_id=0), expected)
    a, b = torch.rand(3, 3) < 0.5, torch.rand(3, 3) < 0.5
    assert torch.equal(combine_masks(a, None, b), a & b)  # type: ignore[arg-type]
    assert combine_masks(None, None) is None


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
        out, weights = mha(x, mask=~key_padding[:, None, None, :], return_weights=True)
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
        out, weights = mha(x, causal=True, return_weights=True)
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
        out, weights = mha(x, context=ctx, mask=~key_padding[:, None, None, :], return_weights=True)
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
        out_g, w_g = gqa(x, mask=mask, causal=True, return_weights=True)
        out_m, w_m = mha(x, mask=mask, causal=True, return_weights=True)
        ctx = torch.randn(2, 3, d_model)
        cross_g, cross_m = gqa(x, context=ctx), mha(x, context=ctx)
    assert (out_g - out_m).abs().max().item() <= 1e-5
    assert (w_g - w_m).abs().max().item() <= 1e-6
    assert (cross_g - cross_m).abs().max().item() <= 1e-5


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
        _, w = mha(x, return_weights=True)
        _, w_perm = mha(x[:, perm], return_weights=True)
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
                out_x, _ = mha(x, causal=True, return_weights=True)
                out_y, _ = mha(y, causal=True, return_weights=True)
            else:
                out_x, out_y = mha(x, causal=True), mha(y, causal=True)
            assert (out_x[:, : p + 1] - out_y[:, : p + 1]).abs().max().item() <= 1e-6
            assert (out_x[:, p + 1 :] - out_y[:, p + 1 :]).abs().max().item() > 1e-4  # the future did change


def test_mha_weights_rows_sum_to_one_with_padding() -> None:
    """MHA's returned weights are a distribution over the real keys."""
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        _, w = mha(x, mask=padding_mask_from_lengths([5, 2]), return_weights=True)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 5), atol=1e-6)
    assert (w[1, :, :, 2:] == 0).all()


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def test_kv_cache_append_grows_and_keeps_contents() -> None:
    """Appends past the initial capacity reallocate and keep every earlier entry."""
    cache = KVCache(capacity=2)
    ks, vs = [], []
    for n in (1, 3, 2, 5):
        k, v = torch.randn(2, 3, n, 4), torch.randn(2, 3, n, 4)
        ks.append(k)
        vs.append(v)
        k_all, v_all = cache.append(k, v)
        assert torch.equal(k_all, torch.cat(ks, dim=2))
        assert torch.equal(v_all, torch.cat(vs, dim=2))
    assert cache.length == 11
    assert cache.capacity >= 11
    assert cache.nbytes() == 2 * 2 * 3 * 11 * 4 * 4
    index = torch.tensor([1, 0])
    cache.reorder(index)
    k_all, v_all = cache.keys_values()
    assert torch.equal(k_all, torch.cat(ks, dim=2)[index])
    assert torch.equal(v_all, torch.cat(vs, dim=2)[index])


def test_cache_helpers() -> None:
    """new_cache, cache_length and reorder_cache work over all layers."""
    caches = new_cache(3, capacity=4)
    assert len(caches) == 3 and all(isinstance(c, LayerCache) for c in caches)
    assert cache_length(caches) == 0 and cache_length(None) == 0
    for c in caches:
        c.self_attn.append(torch.arange(6.0).reshape(2, 1, 3, 1), torch.zeros(2, 1, 3, 1))
        c.cross_attn.set(torch.arange(4.0).reshape(2, 1, 2, 1), torch.zeros(2, 1, 2, 1))
    assert cache_length(caches) == 3
    reorder_cache(caches, torch.tensor([1, 1]))
    for c in caches:
        assert torch.equal(c.self_attn.keys_values()[0][:, 0, :, 0], torch.tensor([[3.0, 4, 5], [3, 4, 5]]))
        assert torch.equal(c.cross_attn.keys_values()[0][:, 0, :, 0], torch.tensor([[2.0, 3], [2, 3]]))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("use_rope", [False, True])
def test_mha_incremental_decoding_matches_full_causal(n_kv_heads: int, use_rope: bool) -> None:
    """Feeding tokens one (or a few) at a time through the cache equals one causal pass."""
    mha = MultiHeadAttention(16, 4, n_kv_heads=n_kv_heads).eval()
    rotary = RotaryEmbedding(4, 32)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        full = mha(x, causal=True, rope=rotary(7) if use_rope else None)
        cache = KVCache(capacity=2)
        steps, pos = [], 0
        for n in (3, 1, 1, 2):
            rope = rotary(n, start=pos) if use_rope else None
            steps.append(mha(x[:, pos : pos + n], causal=True, cache=cache, rope=rope))
            pos += n
    assert cache.length == 7
    assert cache.keys_values()[0].shape == (2, n_kv_heads, 7, 4)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


def test_cross_attention_cache_is_filled_once() -> None:
    """Cross-attention stores the context's K/V on the first call and reuses them afterwards."""
    mha = MultiHeadAttention(16, 4).eval()
    x, ctx = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    cache = KVCache()
    with torch.no_grad():
        full = mha(x, context=ctx)
        first = mha(x[:, :1], context=ctx, cache=cache)
        rest = mha(x[:, 1:], context=ctx, cache=cache)
    assert cache.length == 5
    assert (torch.cat([first, rest], dim=1) - full).abs().max().item() <= 1e-6


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((_t(4), _t(2, 4), _t(2, 4)), {}, r"q must have shape"),
        ((_t(3, 4), _t(4), _t(2, 4)), {}, r"k must have shape"),
        ((_t(3, 4), _t(2, 4), _t(2)), {}, r"v must have shape"),
        ((_t(3, 4), _t(2, 5), _t(2, 4)), {}, r"d_k.*q has d_k=4, k has d_k=5"),
        ((_t(3, 4), _t(2, 4), _t(5, 4)), {}, r"same number of keys T_k: k has 2, v has 5"),
        ((_t(3, 4), _t(2, 4, dtype=torch.float64), _t(2, 4)), {}, r"share a dtype"),
        ((_t(2, 3, 4), _t(5, 2, 4), _t(5, 2, 4)), {}, r"leading \(batch/head\) dims do not broadcast"),
        ((_t(3, 4), _t(2, 4), _t(2, 4)), {"mask": torch.ones(3, 2)}, r"mask must be boolean"),
        ((_t(3, 4), _t(2, 4), _t(2, 4)), {"mask": torch.ones(3, 5, dtype=torch.bool)}, r"mask of shape \(3, 5\)"),
        ((_t(3, 4), _t(2, 4), _t(2, 4)), {"mask": torch.ones(2, dtype=torch.bool)}, r"mask of shape \(2,\)"),
        ((_t(3, 4), _t(2, 4), _t(2, 4)), {"backend": "flash"}, r"unknown attention backend 'flash'"),
        ((_t(3, 4), _t(2, 4), _t(2, 4)), {"backend": "fused", "return_weights": True}, r"cannot return"),
    ],
)
def test_sdpa_bad_inputs(args: tuple, kwargs: dict, match: str) -> None:
    """Misshapen or mistyped inputs raise QkvError naming the problem."""
    with pytest.raises(QkvError, match=match):
        scaled_dot_product_attention(*args, **kwargs)


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


def test_kv_cache_grows_geometrically() -> None:
    """Appending one token at a time reallocates O(log T) times, not once per token."""
    from qkv.attention.cache import KVCache

    cache = KVCache(capacity=4)
    capacities = []
    for _ in range(100):
        cache.append(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3))
        capacities.append(cache.capacity)
    assert sorted(set(capacities)) == [4, 8, 16, 32, 64, 128]
    assert cache.length == 100
