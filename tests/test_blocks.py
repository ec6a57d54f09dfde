"""Tests for qkv.blocks: feed-forward (incl. SwiGLU), residual placement, and parity of the encoder
and decoder stacks with torch.nn.Transformer (post-norm and pre-norm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import with_maps
from torch import Tensor, nn

from qkv import MultiHeadAttention, QkvError
from qkv.attention import MultiHeadAttentionConfig, padding_mask_from_lengths
from qkv.blocks import (
    BlockConfig,
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    FeedForward,
    FeedForwardConfig,
    MoEConfig,
    ResidualNorm,
    StackConfig,
)
from qkv.blocks.dropout import Dropout, dropout
from qkv.norms import LayerNorm, NormConfig

# --------------------------------------------------------------------------------------------
# Feed-forward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_feed_forward_matches_formula(activation: str, bias: bool) -> None:
    """W_2 · act(W_1 x + b_1) + b_2 (SiLU: act(h) = h · σ(h)), with SwiGLU as W_2 (silu(W_g x) ⊙ W_1 x)."""
    ffn = FeedForward(6, 10, activation=activation, bias=bias)
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_(std=0.5)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    ffn = ffn.double()
    w1, w2 = ffn.up.weight, ffn.down.weight
    b1 = ffn.up.bias if bias else torch.zeros(10, dtype=torch.float64)
    b2 = ffn.down.bias if bias else torch.zeros(6, dtype=torch.float64)
    h = x @ w1.T + b1
    if activation == "relu":
        h = h.clamp(min=0)
    elif activation == "gelu":
        h = 0.5 * h * (1 + torch.erf(h / 2**0.5))
    elif activation == "gelu_tanh":
        h = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
    elif activation == "silu":
        h = h / (1 + torch.exp(-h))
    else:
        assert ffn.gate is not None
        g = x @ ffn.gate.weight.T + (ffn.gate.bias if bias else 0.0)
        h = g * torch.sigmoid(g) * h
    expected = h @ w2.T + b2
    assert (ffn(x) - expected).abs().max().item() <= 1e-10


def test_feed_forward_parameter_counts_and_position_wise() -> None:
    """2·d·d_ff (+ biases) parameters, 3·d·d_ff for SwiGLU; each token is transformed independently."""
    n = sum(p.numel() for p in FeedForward(8, 32).parameters())
    assert n == 2 * 8 * 32 + 32 + 8
    n_swiglu = sum(p.numel() for p in FeedForward(8, 32, activation="swiglu", bias=False).parameters())
    assert n_swiglu == 3 * 8 * 32
    ffn = FeedForward(8, 32, activation="swiglu")
    x = torch.randn(2, 5, 8)
    out = ffn(x)
    assert torch.allclose(out[:, 2], ffn(x[:, 2:3])[:, 0], atol=1e-6)
    with pytest.raises(QkvError, match=r"unknown activation 'tanh'"):
        FeedForward(8, 32, activation="tanh")


def test_feed_forward_dropout_only_in_training() -> None:
    """Dropout is active in train mode and off in eval mode."""
    ffn = FeedForward(8, 64, dropout=0.5)
    x = torch.randn(4, 8)
    ffn.eval()
    assert torch.equal(ffn(x), ffn(x))
    ffn.train()
    assert not torch.equal(ffn(x), ffn(x))


# --------------------------------------------------------------------------------------------
# Dropout (four masks per 64-bit random draw on the CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_dropout_keep_rate_per_lane_and_expected_value(p: float) -> None:
    """Each of the four 16-bit lanes of a draw keeps 1 − p of its elements (within 5σ); E[out] = x."""
    torch.manual_seed(0)
    n = 1 << 20
    out = dropout(torch.ones(n), p)
    kept = out != 0
    q = 1 - round(p * 65536) / 65536  # the exact keep probability
    for lane in range(4):  # elements 4i + lane come from the same 16 bits of every draw
        rate = kept[lane::4].double().mean().item()
        assert abs(rate - q) <= 5 * (q * (1 - q) / (n / 4)) ** 0.5
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / q))  # survivors scaled by 1 / q
    assert abs(out.double().mean().item() - 1) <= 5 * ((1 - q) / q / n) ** 0.5


def test_dropout_lanes_are_independent() -> None:
    """Neighbours (same draw) and elements four apart (next draw) are kept together with probability q²."""
    torch.manual_seed(1)
    n, q = 1 << 20, 0.5
    kept = dropout(torch.ones(n), 1 - q) != 0
    for a, b in [(kept[0::4], kept[1::4]), (kept[1::4], kept[3::4]), (kept[:-4], kept[4:])]:
        both = (a & b).double().mean().item()
        assert abs(both - q * q) <= 5 * (q * q * (1 - q * q) / a.numel()) ** 0.5


def test_dropout_gradient_uses_the_forward_mask() -> None:
    """d out / d x is the forward pass's mask times 1 / q: a dropped element passes no gradient."""
    torch.manual_seed(2)
    x = torch.randn(3, 5, 7, requires_grad=True)  # 105 elements: not a multiple of four
    out = dropout(x, 0.4)
    out.backward(torch.ones_like(out))
    q = 1 - round(0.4 * 65536) / 65536
    kept = out != 0
    assert x.grad is not None
    assert torch.allclose(x.grad, kept.float() / q, rtol=1e-6, atol=0)
    assert torch.allclose(out, x.detach() * kept / q)


def test_dropout_is_the_identity_in_eval_mode_and_seeded_in_training() -> None:
    """Eval mode and p = 0 return x itself; the same seed gives the same mask; bad p is refused."""
    x = torch.randn(64, 16)
    layer = Dropout(0.3)
    assert layer.eval()(x) is x
    assert dropout(x, 0.0) is x
    layer.train()
    torch.manual_seed(3)
    first = layer(x)
    torch.manual_seed(3)
    assert torch.equal(layer(x), first)
    assert not torch.equal(layer(x), first)
    for bad in (-0.1, 1.0):
        with pytest.raises(QkvError, match=r"dropout must be in \[0, 1\)"):
            Dropout(bad)


# --------------------------------------------------------------------------------------------
# Residual placement
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_residual_norm_placement(placement: str) -> None:
    """post: Norm(x + F(x)); pre: x + F(Norm(x))."""
    res = ResidualNorm(8, NormConfig(), pre_norm=placement == "pre", dropout=0.0)
    assert isinstance(res.norm, LayerNorm)
    with torch.no_grad():
        res.norm.weight.normal_()
        res.norm.bias.normal_()  # type: ignore[union-attr]
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 4, 8)
    norm = nn.LayerNorm(8)
    norm.load_state_dict(res.norm.state_dict())
    out = res(x, lin(res.before(x)))
    expected = x + lin(norm(x)) if placement == "pre" else norm(x + lin(x))
    assert torch.allclose(out, expected, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Parity with torch.nn.Transformer
# --------------------------------------------------------------------------------------------


def _copy_attention(dst: MultiHeadAttention, src: nn.MultiheadAttention) -> None:
    wq, wk, wv = src.in_proj_weight.chunk(3)
    bq, bk, bv = src.in_proj_bias.chunk(3)
    for proj, w, b in ((dst.q_proj, wq, bq), (dst.k_proj, wk, bk), (dst.v_proj, wv, bv)):
        proj.weight.copy_(w)
        proj.bias.copy_(b)
    dst.out_proj.weight.copy_(src.out_proj.weight)
    dst.out_proj.bias.copy_(src.out_proj.bias)


def _copy_linear_or_norm(dst: nn.Module, src: nn.Module) -> None:
    dst.get_parameter("weight").copy_(src.get_parameter("weight"))
    dst.get_parameter("bias").copy_(src.get_parameter("bias"))


def _block(n_heads: int = 4, n_kv_heads: int | None = None, d_ff: int | None = None, activation: str = "relu",
           norm: str = "layer", norm_placement: str = "post") -> BlockConfig:
    """A block without dropout."""
    return BlockConfig(attention=MultiHeadAttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, dropout=0.0),
                       ffn=FeedForwardConfig(d_ff=d_ff, activation=activation, dropout=0.0),  # type: ignore[arg-type]
                       norm=NormConfig(kind=norm), norm_placement=norm_placement, dropout=0.0)  # type: ignore[arg-type]


def _build_pair(norm_first: bool) -> tuple[nn.Transformer, Encoder, Decoder]:
    """A torch nn.Transformer (random biases and norms too) and qkv stacks holding its weights."""
    d_model, n_heads, d_ff, n_layers = 16, 4, 24, 2
    ref = nn.Transformer(
        d_model, n_heads, n_layers, n_layers, d_ff, dropout=0.0, activation="relu",
        batch_first=True, norm_first=norm_first,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 1:  # biases are zero and norms are (1, 0) at init: make every one count
                p.normal_(mean=1.0 if "norm" in name and name.endswith("weight") else 0.0, std=0.2)
    block = _block(n_heads=n_heads, d_ff=d_ff, norm_placement="pre" if norm_first else "post")
    enc = Encoder(StackConfig(n_layers=n_layers, block=block, final_norm=True), d_model)
    dec = Decoder(StackConfig(n_layers=n_layers, block=block, final_norm=True), d_model, cross_attention=True)
    with torch.no_grad():
        for mine, theirs in zip(enc.layers, ref.encoder.layers, strict=True):
            assert isinstance(mine, EncoderLayer)
            _copy_attention(mine.self_attn, theirs.self_attn)
            _copy_linear_or_norm(mine.ffn.up, theirs.linear1)
            _copy_linear_or_norm(mine.ffn.down, theirs.linear2)
            _copy_linear_or_norm(mine.attn_residual.norm, theirs.norm1)
            _copy_linear_or_norm(mine.ffn_residual.norm, theirs.norm2)
        for mine, theirs in zip(dec.layers, ref.decoder.layers, strict=True):
            assert isinstance(mine, DecoderLayer)
            assert mine.cross_attn is not None and mine.cross_residual is not None
            _copy_attention(mine.self_attn, theirs.self_attn)
            _copy_attention(mine.cross_attn, theirs.multihead_attn)
            _copy_linear_or_norm(mine.ffn.up, theirs.linear1)
            _copy_linear_or_norm(mine.ffn.down, theirs.linear2)
            _copy_linear_or_norm(mine.self_residual.norm, theirs.norm1)
            _copy_linear_or_norm(mine.cross_residual.norm, theirs.norm2)
            _copy_linear_or_norm(mine.ffn_residual.norm, theirs.norm3)
        assert enc.norm is not None and dec.norm is not None
        _copy_linear_or_norm(enc.norm, ref.encoder.norm)
        _copy_linear_or_norm(dec.norm, ref.decoder.norm)
    n_ref = sum(p.numel() for p in ref.parameters())
    assert sum(p.numel() for p in enc.parameters()) + sum(p.numel() for p in dec.parameters()) == n_ref
    return ref, enc, dec


def _inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    src = torch.randn(3, 7, 16)
    tgt = torch.randn(3, 5, 16)
    src_pad = ~padding_mask_from_lengths([7, 4, 2], max_len=7)[:, 0, 0]  # (B, S), True = padding (torch)
    tgt_pad = ~padding_mask_from_lengths([5, 5, 3], max_len=5)[:, 0, 0]
    return src, tgt, src_pad, tgt_pad


@pytest.mark.filterwarnings("ignore:.*nested:UserWarning")
@pytest.mark.parametrize("norm_first", [False, True])
def test_stacks_match_torch_transformer(norm_first: bool) -> None:
    """Encoder output and decoder output equal nn.Transformer's with padding and the causal mask."""
    ref, enc, dec = _build_pair(norm_first)
    ref.train()  # dropout is 0; train mode keeps torch off its nested-tensor fast path
    src, tgt, src_pad, tgt_pad = _inputs()
    causal = nn.Transformer.generate_square_subsequent_mask(5) != 0  # bool, True = not allowed (torch)
    with torch.no_grad():
        ref_memory = ref.encoder(src, src_key_padding_mask=src_pad)
        ref_out = ref.decoder(
            tgt, ref_memory, tgt_mask=causal, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad
        )
        ref_full = ref(
            src, tgt, tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )  # fmt: skip
        src_mask = ~src_pad[:, None, None, :]  # qkv: True = may attend
        tgt_mask = ~tgt_pad[:, None, None, :]
        memory = enc(src, mask=src_mask)
        out = dec(tgt, memory, self_mask=tgt_mask, memory_mask=src_mask)
    assert (memory - ref_memory).abs().max().item() <= 1e-5
    assert (out - ref_out).abs().max().item() <= 1e-5
    assert (out - ref_full).abs().max().item() <= 1e-5


@pytest.mark.filterwarnings("ignore:.*nested:UserWarning")
@pytest.mark.parametrize("norm_first", [False, True])
def test_stacks_match_torch_transformer_in_eval_mode_on_real_positions(norm_first: bool) -> None:
    """In eval mode torch may take its fast path (zeroing padding): real positions still agree."""
    ref, enc, dec = _build_pair(norm_first)
    ref.eval()
    enc.eval()
    dec.eval()
    src, tgt, src_pad, _ = _inputs()
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)  # bool, True = not allowed
    with torch.no_grad():
        ref_memory = ref.encoder(src, src_key_padding_mask=src_pad)
        ref_out = ref.decoder(tgt, ref_memory, tgt_mask=causal, memory_key_padding_mask=src_pad)
        memory = enc(src, mask=~src_pad[:, None, None, :])
        out = dec(tgt, memory, memory_mask=~src_pad[:, None, None, :])
    real = ~src_pad
    assert (memory[real] - ref_memory[real]).abs().max().item() <= 1e-5
    assert (out - ref_out).abs().max().item() <= 1e-5


def test_decoder_without_cross_attention_and_weights() -> None:
    """A GPT-style decoder needs no memory; weights come back per layer; a cross-attending one needs memory."""
    block = _block(norm_placement="pre")
    gpt = Decoder(StackConfig(n_layers=3, block=block), 16, cross_attention=False)
    x = torch.randn(2, 5, 16)
    out, maps = with_maps(gpt, x)
    assert out.shape == (2, 5, 16)
    assert len(maps.self_attn) == 3 and maps.cross_attn == []
    for w in maps.self_attn:
        assert w.shape == (2, 4, 5, 5)
        assert (w.triu(1) == 0).all()  # causal
    enc = Encoder(StackConfig(n_layers=2, block=block, final_norm=False), 16)
    _, enc_maps = with_maps(enc, x)
    assert len(enc_maps.self_attn) == 2 and (enc_maps.self_attn[0].triu(1) > 0).any()  # bidirectional
    dec = Decoder(StackConfig(n_layers=2, block=block), 16)
    _, dmaps = with_maps(dec, x, torch.randn(2, 3, 16))
    assert len(dmaps.cross_attn) == 2 and dmaps.cross_attn[0].shape == (2, 4, 5, 3)
    with pytest.raises(QkvError, match=r"pass the encoder output as memory"):
        dec(x)


def test_block_config_validation() -> None:
    """A block's parts check their own fields by name; the rules that need the width are checked with it."""
    assert FeedForwardConfig().width(16) == 64 and MultiHeadAttentionConfig(n_heads=4).head_dim(16) == 4
    with pytest.raises(QkvError, match=r"n_heads=5 must divide d_model=16"):
        _block(n_heads=5).check_width(16)
    with pytest.raises(QkvError, match=r"n_kv_heads=3 must divide n_heads=4"):
        MultiHeadAttentionConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(QkvError, match=r"norm_placement must be one of pre, post, got 'middle'"):
        BlockConfig(norm_placement="middle")  # type: ignore[arg-type]
    with pytest.raises(QkvError, match=r"norm eps must be positive"):
        NormConfig(eps=0.0)
    with pytest.raises(QkvError, match=r"d_ff must be an integer ≥ 0 \(0 = attention-only layers\), got -1"):
        FeedForwardConfig(d_ff=-1)
    with pytest.raises(QkvError, match=r"a mixture of experts needs feed-forward layers: d_ff=0"):
        MoEConfig(d_ff=0, experts=4)


def test_an_attention_only_layer_is_self_attention_plus_the_residual() -> None:
    """d_ff=0: no feed-forward and no second residual norm; the layer is x + Attn(Norm(x)) exactly."""
    from qkv.blocks import DecoderLayer

    torch.manual_seed(0)
    layer = DecoderLayer(_block(d_ff=0, norm_placement="pre"), 16, cross_attention=False).eval()
    assert layer.ffn is None and layer.ffn_residual is None
    assert not any("ffn" in name for name, _ in layer.named_parameters())
    x = torch.randn(2, 5, 16)
    h = layer.self_residual.norm(x)
    assert torch.equal(layer(x), x + layer.self_attn(h, causal=True))


def test_silu_known_values_and_config() -> None:
    """silu(x) = x · σ(x) at known points; a plain (ungated) choice with the 4 · d_model default width."""
    ffn = FeedForward(1, 1, activation="silu", bias=False)
    assert ffn.gate is None
    with torch.no_grad():
        ffn.up.weight.fill_(1.0)
        ffn.down.weight.fill_(1.0)
    f64 = torch.float64
    x = torch.tensor([[0.0], [1.0], [-1.0], [20.0]], dtype=f64)
    expected = torch.tensor([[0.0], [0.7310585786300049], [-0.2689414213699951], [19.999999958776925]], dtype=f64)
    assert (ffn.double()(x) - expected).abs().max().item() <= 1e-12
    assert FeedForwardConfig(activation="silu").width(16) == 64
    assert EncoderLayer(_block(activation="silu"), 16).ffn.activation == "silu"


def test_swiglu_block_runs_and_differs_from_relu() -> None:
    """A SwiGLU / RMSNorm block is a working configuration end to end."""
    layer = EncoderLayer(_block(n_kv_heads=2, activation="swiglu", norm="rms", norm_placement="pre"), 16)
    assert layer.ffn.gate is not None
    x = torch.randn(2, 5, 16)
    out = layer(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert F.mse_loss(out, x).item() > 0


@pytest.mark.slow
def test_dropout_compiles_as_a_whole_graph() -> None:
    """Under torch.compile(fullgraph=True) dropout is the compiler's: zeros at rate p, the rest scaled by 1/(1−p)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: dropout(x, 0.25, training=True), fullgraph=True)
    out = compiled(torch.ones(200_000))
    assert (out == 0).float().mean().item() == pytest.approx(0.25, abs=0.01)
    assert out.unique().tolist() == [0.0, pytest.approx(1 / 0.75)]
