"""Tests for qkv.norms: LayerNorm, RMSNorm and BatchNorm against their formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qkv import QkvError
from qkv.norms import BatchNorm, LayerNorm, RMSNorm, make_norm


def _randomise(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    d=st.integers(1, 16),
    eps=st.sampled_from([1e-5, 1e-6, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_layer_norm_matches_formula_and_torch(shape: list[int], d: int, eps: float, seed: int) -> None:
    """(x − mean) / √(biased var + ε) · γ + β, and torch.nn.LayerNorm with the same parameters."""
    torch.manual_seed(seed)
    x = torch.randn(*shape, d, dtype=torch.float64) * 3 + 1
    norm = LayerNorm(d, eps=eps).double()
    _randomise(norm)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / d  # biased: divide by d
    assert norm.bias is not None
    expected = (x - mean) / torch.sqrt(var + eps) * norm.weight + norm.bias
    out = norm(x)
    assert (out - expected).abs().max().item() <= 1e-9
    ref = nn.LayerNorm(d, eps=eps).double()
    ref.load_state_dict(norm.state_dict())
    assert (out - ref(x)).abs().max().item() <= 1e-9


def test_layer_norm_uses_biased_variance_and_eps_inside_sqrt() -> None:
    """Known value: x = (1, 3) has mean 2, biased var 1, so y = ±1/√(1 + ε)."""
    eps = 0.5
    out = LayerNorm(2, eps=eps)(torch.tensor([[1.0, 3.0]]))
    expected = 1 / (1 + eps) ** 0.5  # not 1/√2 (unbiased var = 2) and not 1/(1 + ε)
    assert out[0, 0].item() == pytest.approx(-expected, abs=1e-6)
    assert out[0, 1].item() == pytest.approx(expected, abs=1e-6)
    no_bias = LayerNorm(4, bias=False)
    assert no_bias.bias is None and len(list(no_bias.parameters())) == 1


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    d=st.integers(1, 16),
    eps=st.sampled_from([1e-6, 1e-3, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_formula(shape: list[int], d: int, eps: float, seed: int) -> None:
    """x / √(mean(x²) + ε) · w, with no centring and no shift."""
    torch.manual_seed(seed)
    x = torch.randn(*shape, d) * 2 + 0.5
    norm = RMSNorm(d, eps=eps)
    _randomise(norm)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * norm.weight
    assert (norm(x) - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())
    assert len(list(norm.parameters())) == 1


def test_rms_norm_keeps_half_precision_dtype() -> None:
    """A bf16 module on bf16 input: statistics in float32, output back in bf16."""
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    out = RMSNorm(8).to(torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16
    expected = x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(out.float(), expected, atol=2e-2)


def test_batch_norm_normalises_each_feature_over_batch_and_time() -> None:
    """In training, every feature has mean 0 and (biased) variance 1 over the B·T tokens."""
    x = torch.randn(4, 6, 5) * torch.tensor([1.0, 2, 3, 4, 5]) + torch.tensor([0.0, 1, -2, 3, 10])
    norm = BatchNorm(5).train()
    out = norm(x)
    flat = out.reshape(-1, 5)
    assert torch.allclose(flat.mean(0), torch.zeros(5), atol=1e-5)
    assert torch.allclose(flat.var(0, unbiased=False), torch.ones(5), atol=1e-3)
    mean = x.reshape(-1, 5).mean(0)
    var = x.reshape(-1, 5).var(0, unbiased=False)
    assert torch.allclose(out, (x - mean) / torch.sqrt(var + 1e-5), atol=1e-5)
    # unlike LayerNorm, a token's output depends on the other sequences in the batch
    assert not torch.allclose(norm(x[:1]), out[:1], atol=1e-3)
    norm.eval()  # running statistics in eval
    assert norm(x).shape == x.shape
    with pytest.raises(QkvError, match=r"BatchNorm expects \(B, T, d\)"):
        norm(torch.randn(3, 5))


def test_make_norm() -> None:
    """make_norm builds each kind, with its eps, and names an unknown one."""
    assert isinstance(make_norm("layer", 8, 1e-5), LayerNorm)
    rms = make_norm("rms", 8, 1e-3)
    assert isinstance(rms, RMSNorm) and rms.eps == 1e-3
    assert isinstance(make_norm("batch", 8, 1e-5), BatchNorm)
    with pytest.raises(QkvError, match=r"unknown norm 'group'"):
        make_norm("group", 8, 1e-5)  # type: ignore[arg-type]
