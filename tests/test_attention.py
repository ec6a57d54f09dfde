"""Tests for qkv.attention.sdpa and qkv.attention.masks: both attention paths against an independent
float64 implementation, gradcheck, fully masked rows, and bad inputs.

The attention reference used here is written from the formula, softmax(q kᵀ · scale) v, with
explicit loops over rows and its own masking; it shares no code with qkv.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import model_cfg, with_weights
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from qkv import QkvError, scaled_dot_product_attention
from qkv.attention import (
    causal_mask,
    combine_masks,
    padding_mask_from_ids,
    padding_mask_from_lengths,
    record_attention,
    sliding_window_mask,
)
from qkv.attention.sdpa import Backend

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

    out_ref, weights = with_weights(scaled_dot_product_attention, q, k, v, **kw)
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
    _, weights = with_weights(scaled_dot_product_attention, q, k, v, causal=True)
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
    _, w1 = with_weights(scaled_dot_product_attention, q, k, v, scale=1.0)
    _, wd = with_weights(scaled_dot_product_attention, q, k, v)
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
        out, weights = with_weights(scaled_dot_product_attention, q, k, v, mask=mask)
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
    _, weights = with_weights(
        scaled_dot_product_attention, q, k, v, mask=mask, causal=case["causal"], scale=case["scale"]
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
    ],
)
def test_sdpa_bad_inputs(args: tuple, kwargs: dict, match: str) -> None:
    """Misshapen or mistyped inputs raise QkvError naming the problem."""
    with pytest.raises(QkvError, match=match):
        scaled_dot_product_attention(*args, **kwargs)


def test_the_fused_backend_cannot_record_weights() -> None:
    """Recording needs the reference path: asking for the fused one while recording is a one-line error."""
    with record_attention(), pytest.raises(QkvError, match=r"cannot record"):
        scaled_dot_product_attention(_t(3, 4), _t(2, 4), _t(2, 4), backend="fused")


def test_two_threads_record_the_same_model_at_once() -> None:
    """Each recorder gets every layer of its own forward pass, whatever another thread runs meanwhile."""
    import threading

    from qkv.attention import record_attention
    from qkv.models import DecoderLM, DecoderLMConfig

    torch.manual_seed(0)
    model = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=50, d_model=32, n_heads=2, n_layers=3,
                                max_positions=64)).eval()
    inputs = [torch.randint(0, 50, (1, 40)), torch.randint(0, 50, (1, 24))]
    with record_attention(model) as alone:
        model(inputs[0])
    expected = alone.weights_of()
    failures: list[str] = []

    def record(ids: Tensor) -> None:
        for _ in range(30):
            with torch.no_grad(), record_attention(model) as recorder:
                model(ids)
            shapes = [tuple(w.shape[-2:]) for w in recorder.weights_of("decoder.layers.*.self_attn")]
            if shapes != [(ids.shape[1], ids.shape[1])] * 3:
                failures.append(f"{ids.shape[1]} tokens recorded as {shapes}")

    threads = [threading.Thread(target=record, args=(ids,)) for ids in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    with record_attention(model) as again:
        model(inputs[0])
    for a, b in zip(again.weights_of(), expected, strict=True):
        torch.testing.assert_close(a, b)
