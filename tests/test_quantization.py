"""Tests for qkv.quantization: int8 weight-only Linears against an independent float reference, and the input-major
float32 layout against nn.Linear.

The reference dequantises by hand (q · s, in float64) and multiplies with torch.matmul, so the fused kernel
(torch._weight_int8pack_mm) is checked against plain arithmetic; the rounding error itself is bounded by
half a quantisation step per weight. SmolLM2's greedy text and teacher-forced agreement are in
test_interop_real.py (real weights).
"""

from __future__ import annotations

import pytest
import torch
from helpers import model_cfg
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qkv import DecoderLM, DecoderLMConfig, quantize_int8
from qkv.attention.latent import LatentAttention
from qkv.blocks.moe import MoEFeedForward
from qkv.generation import Sampling, generate
from qkv.quantization import InputMajorLinear, Int8Linear, input_major, weight_bytes


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), k=st.integers(1, 64), rows=st.integers(1, 5),
       bias=st.booleans())  # fmt: skip
def test_int8_linear_is_dequantised_weights_times_x(seed: int, n: int, k: int, rows: int, bias: bool) -> None:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    q = Int8Linear.from_linear(linear)
    w = linear.weight.detach().double()
    s = w.abs().amax(1) / 127  # (N,): the scale of each output channel
    codes = q.weight_int8.double()
    assert q.weight_int8.dtype == torch.int8 and codes.abs().max() <= 127
    assert torch.allclose(q.scales.double(), s)
    # round to nearest: half a step, give or take float32's rounding of w / s (≤ 127 steps: 2⁻¹⁶ of a step)
    assert ((codes * s[:, None] - w).abs() <= s[:, None] * (0.5 + 2**-16)).all()
    x = torch.randn(rows, 3, k)
    fast = k % 16 == 0  # the kernel's fast path: inputs and output in bfloat16 (its output rounded to 8 bits)
    scales = q.scales.bfloat16().double() if fast else s
    inputs = x.bfloat16().double() if fast else x.double()
    expected = inputs @ (codes * scales[:, None]).T + (linear.bias.detach().double() if bias else 0)
    tol = {"atol": 1e-2, "rtol": 1e-2} if fast else {"atol": 1e-4, "rtol": 1e-4}
    assert torch.allclose(q(x).double(), expected, **tol)


def test_int8_linear_in_bfloat16_keeps_the_dtype_and_the_values() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(torch.bfloat16)
    q = Int8Linear.from_linear(linear)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    y = q(x)
    reference = x.float() @ (q.weight_int8.float() * q.scales.float()[:, None]).T + linear.bias.float()
    assert y.dtype == torch.bfloat16 and q.scales.dtype == torch.bfloat16
    assert torch.allclose(y.float(), reference, atol=0.05, rtol=0.02)


def test_zero_rows_stay_zero_and_do_not_divide_by_zero() -> None:
    linear = nn.Linear(8, 3, bias=False)
    with torch.no_grad():
        linear.weight[1] = 0
    q = Int8Linear.from_linear(linear)
    assert torch.isfinite(q.scales).all() and (q.weight_int8[1] == 0).all()
    assert (q(torch.randn(4, 8))[:, 1] == 0).all()


def _lm(tie: bool) -> DecoderLM:
    torch.manual_seed(3)
    cfg = model_cfg(DecoderLMConfig, vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_positions=32,
                    tie_embeddings=tie, positions="rotary", norm="rms", activation="swiglu")  # fmt: skip
    return DecoderLM(cfg).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_quantize_int8_replaces_every_linear_and_keeps_the_model_close(tie: bool) -> None:
    model = _lm(tie)
    ids = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        before = model(ids)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    n_linear = len(linears)
    int8_bytes = sum(m.weight.numel() + 4 * m.out_features for m in linears)  # 1 byte a weight, a scale a row
    assert weight_bytes(model) == sum(4 * m.weight.numel() for m in linears)  # the head once, tied or not
    quantize_int8(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == n_linear
    assert model.embed.tokens.weight.dtype == torch.float32  # the table is indexed, not multiplied: it stays
    assert isinstance(model.lm_head, Int8Linear)  # a tied head gets an int8 copy of its own
    assert weight_bytes(model) == int8_bytes  # the tied head is read as a matrix of its own now
    with torch.no_grad():
        after = model(ids)
    spread = (before.amax(-1) - before.amin(-1)).mean()
    assert ((after - before).abs().max() / spread).item() < 0.06  # int8 weights, bfloat16 inputs to each product
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() > 0.9


def test_quantized_model_decodes_with_the_cache_as_without() -> None:
    model = quantize_int8(_lm(True))
    prompt = torch.randint(0, 50, (2, 5))
    greedy = Sampling(temperature=0.0)
    assert torch.equal(generate(model, prompt, 12, greedy), generate(model, prompt, 12, greedy, use_cache=False))


@pytest.mark.parametrize("absorb", [False, True])
def test_linears_read_as_matrices_stay_float(absorb: bool) -> None:
    """MLA's kv_up (sliced per head for weight absorption) and the MoE router keep their float weights."""
    torch.manual_seed(1)
    cfg = model_cfg(DecoderLMConfig, vocab_size=40, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_positions=32,
                    positions="rotary", attention="mla", mla_absorb=absorb, moe_experts=4)  # fmt: skip
    model = DecoderLM(cfg).eval()
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        before = model(ids)
    quantize_int8(model)
    for layer in model.decoder.layers:
        mla, moe = layer.self_attn, layer.ffn
        assert isinstance(mla, LatentAttention) and isinstance(moe, MoEFeedForward)
        assert isinstance(mla.kv_up, nn.Linear) and isinstance(moe.router, nn.Linear)
        assert isinstance(mla.kv_down, Int8Linear) and isinstance(mla.out_proj, Int8Linear)
    with torch.no_grad():
        after = model(ids)
    spread = (before.amax(-1) - before.amin(-1)).mean()
    assert ((after - before).abs().max() / spread).item() < 0.06  # int8 weights, bfloat16 inputs to each product
    greedy = Sampling(temperature=0.0)
    prompt = ids[:, :4]
    assert torch.equal(generate(model, prompt, 8, greedy), generate(model, prompt, 8, greedy, use_cache=False))


@pytest.mark.parametrize("tie", [True, False])
def test_input_major_layout_computes_the_same_products(tie: bool) -> None:
    """input_major stores each Linear's Wᵀ (in, out): the same logits to float32 rounding, the same greedy text."""
    model = _lm(tie)
    ids = torch.randint(0, 50, (2, 20))
    greedy = Sampling(temperature=0.0)
    with torch.no_grad():
        before = model(ids)
    text = generate(model, ids[:, :5], 12, greedy)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    input_major(model)
    layers = [m for m in model.modules() if isinstance(m, InputMajorLinear)]
    assert len(layers) == n_linear and not any(isinstance(m, nn.Linear) for m in model.modules())
    assert all(m.weight_t.shape == (m.in_features, m.out_features) and m.weight_t.is_contiguous() for m in layers)
    assert model.embed.tokens.weight.shape == (50, 32)  # the table keeps its rows; a tied head has its own copy
    with torch.no_grad():
        assert torch.allclose(model(ids), before, atol=1e-5, rtol=1e-5)
    assert torch.equal(generate(model, ids[:, :5], 12, greedy), text)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n16=st.integers(1, 6), groups=st.integers(1, 4),
       group=st.sampled_from([32, 64]), bias=st.booleans())  # fmt: skip
def test_int4_linear_rounds_each_group_and_multiplies_what_it_reports(seed: int, n16: int, groups: int, group: int,
                                                                       bias: bool) -> None:  # fmt: skip
    """Each weight within half a step of its group's scale, plus the kernel's bfloat16 rounding of scale and minimum;
    the product is x (rounded to bfloat16) times the weights the layer reports."""
    from qkv.quantization import GroupLinear

    torch.manual_seed(seed)
    n, k = 16 * n16, group * groups
    linear = nn.Linear(k, n, bias=bias)
    q = GroupLinear.from_linear(linear, group)
    w = linear.weight.detach().view(n, groups, group)
    step = (w.amax(-1) - w.amin(-1)) / 15  # (N, groups)
    error = (q.dequantize().view(n, groups, group) - w).abs()
    assert (error <= step[..., None] * 0.5 + w.abs().amax(-1, keepdim=True) * 2**-7 + 1e-7).all()
    x = torch.randn(3, k)
    reference = x.bfloat16().double() @ q.dequantize().double().t() + (linear.bias.double() if bias else 0)
    assert (q(x).double() - reference).abs().max() <= 2**-8 * reference.abs().max() + 1e-6


def test_quantize_int4_replaces_the_linears_that_fit_and_decodes_with_the_cache_as_without() -> None:
    from qkv.quantization import GroupLinear, quantize_int4

    torch.manual_seed(0)
    model = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=40, d_model=64, n_heads=4, n_layers=2, d_ff=96,
                                max_positions=32, tie_embeddings=True)).eval()  # fmt: skip
    before = weight_bytes(model)
    quantize_int4(model, 32)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    quantized = [m for m in model.modules() if isinstance(m, GroupLinear)]
    assert [m.out_features % 16 for m in linears] == [8]  # only the 40-row head stays float: 40 is no multiple of 16
    assert len(quantized) == 2 * 6  # q, k, v, out, up, down per layer
    assert weight_bytes(model) < before / 4
    prompt = torch.randint(0, 40, (2, 5))
    greedy = Sampling(temperature=0.0)
    assert torch.equal(generate(model, prompt, 10, greedy), generate(model, prompt, 10, greedy, use_cache=False))
