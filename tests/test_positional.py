"""Tests for qkv.positional: the sinusoidal table, learned positions and rotary embeddings."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import model_cfg
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import QkvError
from qkv.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    SinusoidalPositionsConfig,
    apply_rotary,
    rotate_half,
    sinusoidal_table,
)


@settings(max_examples=60, deadline=None)
@given(
    half_d=st.integers(1, 64),
    max_len=st.integers(1, 2048),
    data=st.data(),
)
def test_sinusoidal_table_matches_the_formula(half_d: int, max_len: int, data: st.DataObject) -> None:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) at sampled entries."""
    d = 2 * half_d
    table = sinusoidal_table(max_len, d)
    assert table.shape == (max_len, d)
    assert table.dtype == torch.float32
    for _ in range(8):
        pos = data.draw(st.integers(0, max_len - 1))
        i = data.draw(st.integers(0, half_d - 1))
        angle = pos / 10000 ** (2 * i / d)
        assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert table.abs().max().item() <= 1.0


def test_sinusoidal_known_values_and_range() -> None:
    """Row 0 alternates 0, 1; the last pair has the slowest frequency; every value lies in [−1, 1]."""
    table = sinusoidal_table(5000, 64)
    assert torch.equal(table[0, 0::2], torch.zeros(32))
    assert torch.equal(table[0, 1::2], torch.ones(32))
    assert table[1, 0].item() == pytest.approx(math.sin(1.0), abs=1e-7)
    assert table[4999, 62].item() == pytest.approx(math.sin(4999 / 10000 ** (62 / 64)), abs=1e-6)
    assert table.min().item() >= -1.0 and table.max().item() <= 1.0
    # PE(pos + k) is a fixed rotation of PE(pos): the dot product depends on k only
    dots = [(table[p] @ table[p + 7]).item() for p in (0, 100, 3000)]
    assert dots[0] == pytest.approx(dots[1], abs=1e-4) and dots[0] == pytest.approx(dots[2], abs=1e-4)


def test_sinusoidal_module_slices_the_table() -> None:
    """The module returns rows start .. start + length − 1 and refuses positions past max_len."""
    enc = SinusoidalPositionalEncoding(8, 10)
    assert torch.equal(enc(3, start=4), sinusoidal_table(10, 8)[4:7])
    assert len(list(enc.parameters())) == 0
    assert "table" not in enc.state_dict()
    with pytest.raises(QkvError, match=r"position 11 but the model has max_positions=10"):
        enc(3, start=8)
    with pytest.raises(QkvError, match=r"even d_model"):
        sinusoidal_table(4, 7)


def test_sinusoidal_halves_layout_known_values() -> None:
    """layout="halves" (Marian): PE(pos, i) = sin(pos / 10000^(2i/d)) and PE(pos, d/2 + i) the cosine, for i < d/2."""
    d, half = 8, 4
    table = sinusoidal_table(50, d, layout="halves")
    for pos in (0, 1, 7, 49):
        for i in range(half):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, i].item() == pytest.approx(math.sin(angle), abs=1e-7)
            assert table[pos, half + i].item() == pytest.approx(math.cos(angle), abs=1e-7)
    assert torch.equal(table[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert table[1, 0].item() == pytest.approx(0.8414709848, abs=1e-7)  # sin(1)
    assert table[1, 4].item() == pytest.approx(0.5403023059, abs=1e-7)  # cos(1)
    # The same numbers as the paper's interleaved table, its dims reordered: [0, 2, 4, 6 | 1, 3, 5, 7].
    interleaved = sinusoidal_table(50, d)
    assert torch.equal(table, interleaved[:, [0, 2, 4, 6, 1, 3, 5, 7]])
    assert torch.equal(SinusoidalPositionalEncoding(d, 50, layout="halves")(3, start=2), table[2:5])
    with pytest.raises(QkvError, match=r"unknown sinusoid layout 'sideways'"):
        sinusoidal_table(4, 8, layout="sideways")  # type: ignore[arg-type]


def test_sinusoid_layout_is_a_validated_config_choice() -> None:
    """The paper's interleaving is the default; "halves" reaches the embeddings; nonsense is refused by name."""
    from qkv import DecoderLMConfig, Transformer, TransformerConfig

    base = dict(src_vocab_size=11, tgt_vocab_size=11, d_model=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=1)
    assert model_cfg(TransformerConfig, **base).embedding.positions == SinusoidalPositionsConfig(layout="interleaved")
    model = Transformer(model_cfg(TransformerConfig, **base, sinusoid_layout="halves"))  # type: ignore[arg-type]
    assert model.src_embed.positions is not None
    assert torch.equal(model.tgt_embed.positions(5), sinusoidal_table(5, 8, layout="halves"))
    with pytest.raises(QkvError, match=r"layout must be one of interleaved, halves, got 'sideways'"):
        model_cfg(TransformerConfig, **base, sinusoid_layout="sideways")  # type: ignore[arg-type]
    with pytest.raises(QkvError, match=r"embedding.positions has no field 'layout'"):
        model_cfg(DecoderLMConfig, vocab_size=11, d_model=8, n_heads=2, sinusoid_layout="halves")


def test_learned_positions() -> None:
    """One trainable vector per position, sliced by start."""
    emb = LearnedPositionalEmbedding(6, 12)
    assert emb.weight.shape == (12, 6) and emb.weight.requires_grad
    assert torch.equal(emb(4, start=2), emb.weight[2:6])
    with pytest.raises(QkvError, match=r"max_positions=12"):
        emb(13)


def test_rotary_tables_and_rotation() -> None:
    """cos/sin use the rotate-half pairing; rotation keeps norms; position 0 is the identity."""
    rot = RotaryEmbedding(8, 64, base=10000.0)
    cos, sin = rot(64)
    for pos in (0, 5, 63):
        for i in range(4):
            angle = pos / 10000 ** (2 * i / 8)
            assert cos[pos, i].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert cos[pos, i + 4].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert sin[pos, i].item() == pytest.approx(math.sin(angle), abs=1e-6)
    x = torch.randn(2, 3, 64, 8)
    y = apply_rotary(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.equal(y[:, :, 0], x[:, :, 0])
    assert torch.equal(rotate_half(torch.tensor([1.0, 2, 3, 4])), torch.tensor([-3.0, -4, 1, 2]))
    c3, s3 = rot(4, start=3)
    assert torch.equal(c3, cos[3:7]) and torch.equal(s3, sin[3:7])
    with pytest.raises(QkvError, match=r"even head dim"):
        RotaryEmbedding(5, 8)


@settings(max_examples=50, deadline=None)
@given(
    head_dim=st.sampled_from([2, 4, 8, 16, 32]),
    m=st.integers(0, 200),
    n=st.integers(0, 200),
    s=st.integers(0, 200),
    seed=st.integers(0, 2**16),
)
def test_rope_dot_product_depends_only_on_offset(head_dim: int, m: int, n: int, s: int, seed: int) -> None:
    """q·k after rotating q at m and k at n equals the same at (m + s, n + s)."""
    rot = RotaryEmbedding(head_dim, 401)
    cos, sin = rot(401)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(head_dim, generator=gen, dtype=torch.float64)

    def dot(pq: int, pk: int) -> float:
        return float(apply_rotary(q, cos[pq], sin[pq]) @ apply_rotary(k, cos[pk], sin[pk]))

    base = dot(m, n)
    shifted = dot(m + s, n + s)
    assert shifted == pytest.approx(base, abs=1e-4 * head_dim)
    if m == n:  # same position: the rotation cancels, q·k unchanged
        assert base == pytest.approx(float(q @ k), abs=1e-4 * head_dim)


def test_rope_dot_product_does_change_with_offset() -> None:
    """The relative offset matters: (0, 0) and (0, 5) give different scores."""
    cos, sin = RotaryEmbedding(8, 16)(16)
    q = torch.randn(8, dtype=torch.float64)
    at = [float(apply_rotary(q, cos[0], sin[0]) @ apply_rotary(q, cos[j], sin[j])) for j in (0, 5)]
    assert abs(at[0] - at[1]) > 1e-3
