"""Tests for qkv.models and qkv.config: parameter counts of known architectures, KV-cache decoding
equals the full forward, causality, configs, and bad inputs."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest
import torch
from helpers import model_cfg, with_maps
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import DecoderLM, DecoderLMConfig, EncoderConfig, EncoderModel, QkvError, Transformer, TransformerConfig
from qkv.attention import (
    LatentAttentionConfig,
    MultiHeadAttention,
    MultiHeadAttentionConfig,
    padding_mask_from_lengths,
)
from qkv.blocks import BlockConfig, FeedForwardConfig, MoEConfig, StackConfig
from qkv.generation import generate
from qkv.norms import NormConfig, RMSNorm
from qkv.positional import RotaryEmbedding, RotaryPositionsConfig, sinusoidal_table


def n_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied matrices counted once, as model.parameters() yields them once)."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------


def test_paper_base_parameter_count() -> None:
    """The paper's base model has about 65 M parameters (Table 3); shared 37k vocabulary."""
    model = Transformer(TransformerConfig.paper_base(37000))
    assert 60_000_000 <= n_params(model) <= 66_000_000
    assert model.generator.weight is model.tgt_embed.tokens.weight is model.src_embed.tokens.weight


def test_paper_big_parameter_count() -> None:
    """The big model has about 213 M parameters."""
    with torch.device("meta"):  # same modules and parameter shapes, without allocating 0.9 GB
        model = Transformer(TransformerConfig.paper_big(37000))
    assert 205_000_000 <= n_params(model) <= 215_000_000


def test_gpt2_small_parameter_count_is_exact() -> None:
    """GPT-2 small (LayerNorm, GELU, biases, tied head, 1024 learned positions) has 124,439,808 parameters."""
    cfg = model_cfg(DecoderLMConfig, vocab_size=50257, max_positions=1024, n_layers=12, d_model=768, n_heads=12)
    block = cfg.decoder.block
    assert (block.norm.kind, block.ffn.activation, block.attention.bias, block.ffn.bias) == ("layer", "gelu", True,
                                                                                            True)  # fmt: skip
    assert cfg.tie_embeddings
    model = DecoderLM(cfg)
    assert model.lm_head.weight is model.embed.tokens.weight
    assert n_params(model) == 124_439_808


def test_small_counts_by_hand() -> None:
    """A tiny DecoderLM's count, term by term."""
    v, d, t, n, f = 11, 8, 16, 2, 32
    model = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=v, d_model=d, n_heads=2, n_layers=n, max_positions=t,
                                d_ff=f))  # fmt: skip
    per_layer = 4 * (d * d + d) + (d * f + f + f * d + d) + 2 * 2 * d
    assert n_params(model) == v * d + t * d + n * per_layer + 2 * d
    untied = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=v, d_model=d, n_heads=2, n_layers=n, max_positions=t,
                                 d_ff=f, tie_embeddings=False))  # fmt: skip
    assert n_params(untied) == n_params(model) + v * d
    gqa = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=v, d_model=d, n_heads=2, n_kv_heads=1, n_layers=n,
                              max_positions=t, d_ff=f))  # fmt: skip
    assert n_params(gqa) == n_params(model) - n * 2 * (d * d // 2 + d // 2)


# --------------------------------------------------------------------------------------------
# KV-cache decoding equals the full forward
# --------------------------------------------------------------------------------------------

LM_VARIANTS: dict[str, dict[str, Any]] = {
    "learned": dict(positions="learned"),
    "sinusoidal": dict(positions="sinusoidal"),
    "rotary": dict(positions="rotary"),
    "rotary_gqa": dict(positions="rotary", n_kv_heads=2),
    "learned_mqa_post_rms_swiglu": dict(
        positions="learned", n_kv_heads=1, norm="rms", norm_placement="post", activation="swiglu"
    ),
}


@functools.cache
def tiny_lm(variant: str) -> DecoderLM:
    """A small DecoderLM in eval mode (built once per variant)."""
    torch.manual_seed(1)
    cfg = model_cfg(DecoderLMConfig,
                    vocab_size=23, d_model=16, n_heads=4, n_layers=2, max_positions=32, d_ff=32, **LM_VARIANTS[variant]
                    )
    return DecoderLM(cfg).eval()


@settings(max_examples=12, deadline=None)
@given(
    variant=st.sampled_from(sorted(LM_VARIANTS)),
    t=st.integers(2, 12),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_decoder_lm_cached_decoding_equals_full_forward(variant: str, t: int, data: st.DataObject, seed: int) -> None:
    """Prefill a prompt chunk, then feed one token at a time: logits equal one full pass (≤ 1e-5)."""
    model = tiny_lm(variant)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 23, (2, t), generator=gen)
    prompt = data.draw(st.integers(1, t))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(capacity=data.draw(st.sampled_from([1, 4, 256])))
        pieces = [model(ids[:, :prompt], cache=cache)]
        for i in range(prompt, t):
            pieces.append(model(ids[:, i : i + 1], cache=cache))
    assert cache[0].self_attn.length == t
    stepped = torch.cat(pieces, dim=1)
    assert stepped.shape == full.shape == (2, t, 23)
    assert (stepped - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", sorted(LM_VARIANTS))
def test_decoder_lm_token_by_token_from_the_start(variant: str) -> None:
    """Every variant (learned, sinusoidal, rotary positions, GQA, MQA) decodes one token at a time exactly."""
    model = tiny_lm(variant)
    ids = torch.randint(0, 23, (3, 9))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        stepped = torch.cat([model(ids[:, i : i + 1], cache=cache) for i in range(9)], dim=1)
    assert (stepped - full).abs().max().item() <= 1e-5


def tiny_transformer(positions: str = "sinusoidal", **kw: object) -> Transformer:
    torch.manual_seed(2)
    cfg = model_cfg(TransformerConfig,
                    src_vocab_size=19, tgt_vocab_size=17, d_model=16, n_heads=4, d_ff=32, n_encoder_layers=2,
                    n_decoder_layers=2, dropout=0.0, max_positions=32, positions=positions, **kw,  # type: ignore[arg-type]
                    )  # fmt: skip
    return Transformer(cfg).eval()


TRANSFORMER_VARIANTS: dict[str, dict[str, Any]] = {
    "sinusoidal_post": dict(positions="sinusoidal"),
    "learned_pre": dict(positions="learned", norm_placement="pre"),
    "rotary_gqa": dict(positions="rotary", n_kv_heads=2),
}


@functools.cache
def cached_transformer(variant: str) -> Transformer:
    return tiny_transformer(**TRANSFORMER_VARIANTS[variant])


@settings(max_examples=12, deadline=None)
@given(
    variant=st.sampled_from(sorted(TRANSFORMER_VARIANTS)),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    t=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_transformer_cached_decoding_equals_full_decode(variant: str, lengths: list[int], t: int, seed: int) -> None:
    """encode once, then decode token by token with model.new_cache(): same logits as decoding at once."""
    model = cached_transformer(variant)
    gen = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(lengths)
    src = torch.randint(1, 19, (b, s), generator=gen)
    src_mask = padding_mask_from_lengths(lengths)
    src = src.masked_fill(~src_mask[:, 0, 0], 0)
    tgt = torch.randint(1, 17, (b, t), generator=gen)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, src_mask)
        teacher_forced = model(src, tgt, src_mask)
        cache = model.new_cache(capacity=2)
        stepped = torch.cat([model.decode(tgt[:, i : i + 1], memory, src_mask, cache=cache) for i in range(t)], dim=1)
    assert (teacher_forced - full).abs().max().item() <= 1e-6
    assert stepped.shape == full.shape == (b, t, 17)
    assert (stepped - full).abs().max().item() <= 1e-5
    assert cache[0].cross_attn.length == s and cache[0].self_attn.length == t


def test_transformer_padding_in_source_is_ignored() -> None:
    """With the source mask, what sits in padded source positions does not change the logits."""
    model = tiny_transformer()
    src = torch.randint(1, 19, (2, 6))
    src_mask = padding_mask_from_lengths([6, 3])
    tgt = torch.randint(1, 17, (2, 4))
    other = src.clone()
    other[1, 3:] = torch.randint(1, 19, (3,))
    with torch.no_grad():
        a, b = model(src, tgt, src_mask), model(other, tgt, src_mask)
        c = model(other, tgt)
    assert (a - b).abs().max().item() <= 1e-6
    assert (a[1] - c[1]).abs().max().item() > 1e-4


# --------------------------------------------------------------------------------------------
# Causality
# --------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(variant=st.sampled_from(sorted(LM_VARIANTS)), t=st.integers(2, 12), data=st.data(), seed=st.integers(0, 999))
def test_decoder_lm_is_causal(variant: str, t: int, data: st.DataObject, seed: int) -> None:
    """Logits at positions ≤ p do not change when tokens after p change."""
    model = tiny_lm(variant)
    p = data.draw(st.integers(0, t - 2))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 23, (2, t), generator=gen)
    other = ids.clone()
    other[:, p + 1 :] = (ids[:, p + 1 :] + torch.randint(1, 23, (2, t - p - 1), generator=gen)) % 23
    with torch.no_grad():
        a, b = model(ids), model(other)
    assert (a[:, : p + 1] - b[:, : p + 1]).abs().max().item() <= 1e-6
    assert (a[:, p + 1 :] - b[:, p + 1 :]).abs().max().item() > 1e-6  # the changed tokens do matter


def test_transformer_decoder_is_causal_and_encoder_is_not() -> None:
    """Target token t+1 cannot influence decoder logits at t; any source token influences every logit."""
    model = tiny_transformer()
    src, tgt = torch.randint(1, 19, (1, 5)), torch.randint(1, 17, (1, 6))
    tgt2 = tgt.clone()
    tgt2[0, 4] = (tgt[0, 4] + 1) % 17
    src2 = src.clone()
    src2[0, 4] = (src[0, 4] + 1) % 19
    with torch.no_grad():
        a, b, c = model(src, tgt), model(src, tgt2), model(src2, tgt)
    assert (a[:, :4] - b[:, :4]).abs().max().item() <= 1e-6
    assert (a[:, 4:] - b[:, 4:]).abs().max().item() > 1e-5
    assert ((a - c).abs().amax(-1) > 1e-6).all()


def test_decoder_lm_left_padding_with_rotary_positions() -> None:
    """With rotary positions and the padding mask, a left-padded row gives the unpadded row's logits."""
    model = tiny_lm("rotary")
    seq = torch.randint(1, 23, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), seq], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 5])
    with torch.no_grad():
        plain = model(seq)
        masked = model(padded, padding_mask=mask)
        unmasked = model(padded)
    assert (masked[:, 3:] - plain).abs().max().item() <= 1e-5
    assert (unmasked[:, 3:] - plain).abs().max().item() > 1e-4


# --------------------------------------------------------------------------------------------
# Embeddings, weights and other model behaviour
# --------------------------------------------------------------------------------------------


def test_transformer_embeddings_scale_and_positions() -> None:
    """Transformer embeds tokens × √d_model plus the sinusoidal table; weights are tied."""
    model = tiny_transformer()
    ids = torch.tensor([[3, 5, 7]])
    x, rope = model.src_embed(ids)
    expected = model.src_embed.tokens.weight[ids] * math.sqrt(16) + sinusoidal_table(32, 16)[:3]
    assert rope is None
    assert torch.allclose(x, expected, atol=1e-6)
    assert model.generator.weight is model.tgt_embed.tokens.weight
    assert model.src_embed.tokens is not model.tgt_embed.tokens  # different vocabularies


def test_decoder_lm_recorded_attention_maps() -> None:
    """Recording the attention gives per-layer causal maps whose rows sum to 1."""
    model = tiny_lm("learned")
    logits, maps = with_maps(model, torch.randint(0, 23, (2, 6)))
    assert logits.shape == (2, 6, 23)
    assert len(maps.self_attn) == 2
    for w in maps.self_attn:
        assert w.shape == (2, 4, 6, 6)
        assert torch.allclose(w.sum(-1), torch.ones(2, 4, 6), atol=1e-5)
        assert (w.triu(1) == 0).all()


def test_encoder_model_outputs_and_padding() -> None:
    """EncoderModel: hidden states, pooled output, padding ignored, mean pooling over real tokens."""
    torch.manual_seed(3)
    cfg = model_cfg(EncoderConfig, vocab_size=30, d_model=16, n_heads=4, n_layers=2, max_positions=16, dropout=0.0)
    model = EncoderModel(cfg).eval()
    ids = torch.randint(1, 30, (2, 6))
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    other = ids.clone()
    other[1, 3:] = (ids[1, 3:] + 1) % 30
    with torch.no_grad():
        out = model(ids, attn)
        out2 = model(other, attn)
        pooled = model.mean_pool(ids, attn)
    assert out.hidden.shape == (2, 6, 16) and out.pooled is not None and out.pooled.shape == (2, 16)
    assert (out.hidden[1, :3] - out2.hidden[1, :3]).abs().max().item() <= 1e-5
    assert torch.allclose(pooled[1], out.hidden[1, :3].mean(0), atol=1e-6)
    with pytest.raises(QkvError, match=r"attention_mask must match ids' shape"):
        model(ids, attn[:, :4])


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def test_config_defaults_and_round_trip() -> None:
    """Family defaults, widths left to the model, and to_dict / from_dict round trips of the whole tree."""
    lm = DecoderLMConfig(vocab_size=100)
    block = lm.decoder.block
    assert (block.norm_placement, block.ffn.activation, lm.decoder.has_final_norm()) == ("pre", "gelu", True)
    assert (block.ffn.d_ff, block.ffn.width(lm.d_model)) == (None, 2048)  # 4 · d_model, as the config is built
    tr = TransformerConfig(src_vocab_size=10, tgt_vocab_size=12)
    assert (tr.encoder.block.norm_placement, tr.embedding.positions.kind, tr.embedding.scale) == ("post", "sinusoidal",
                                                                                                 True)  # fmt: skip
    assert not tr.encoder.has_final_norm() and not tr.decoder.has_final_norm()
    for cfg in (lm, tr, EncoderConfig(vocab_size=5), BlockConfig(), StackConfig(n_layers=2)):
        assert type(cfg).from_dict(cfg.to_dict()) == cfg
        assert type(cfg).from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # through JSON
    assert lm.to_dict()["decoder"]["block"]["attention"]["kind"] == "mha"  # a part with kinds says which


def test_each_part_builds_its_module() -> None:
    """A config's build() makes its module: a norm, positions, an attention, a feed-forward, a model."""
    assert isinstance(NormConfig(kind="rms").build(8), RMSNorm)
    assert isinstance(RotaryPositionsConfig().build(8, 16, rotary_dim=4), RotaryEmbedding)
    attention = MultiHeadAttentionConfig(n_heads=2, n_kv_heads=1).build(8)
    assert isinstance(attention, MultiHeadAttention) and (attention.n_heads, attention.n_kv_heads) == (2, 1)
    ffn = FeedForwardConfig(activation="swiglu").build(48)
    assert ffn is not None and ffn.up.out_features == 128  # ⌈8/3 · 48⌉ rounded to a multiple of 8
    assert FeedForwardConfig(d_ff=0).build(8) is None  # an attention-only block
    assert isinstance(DecoderLMConfig(vocab_size=10, d_model=16).override({"n_heads": 2}).build(), DecoderLM)


def test_per_layer_blocks_and_per_side_shapes() -> None:
    """A stack may give its first layers blocks of their own; an encoder–decoder's sides differ in heads, widths
    and depth."""
    dense, moe = BlockConfig(), BlockConfig(ffn=MoEConfig(experts=4, d_ff=8))
    stack = StackConfig(n_layers=3, block=moe, layers=(dense,))
    assert stack.blocks() == [dense, moe, moe]
    cfg = TransformerConfig(src_vocab_size=11, tgt_vocab_size=11, d_model=16,
                            encoder=StackConfig(n_layers=1, block=BlockConfig(attention=MultiHeadAttentionConfig(
                                n_heads=2), ffn=FeedForwardConfig(d_ff=24))),
                            decoder=StackConfig(n_layers=3, block=BlockConfig(attention=MultiHeadAttentionConfig(
                                n_heads=4), ffn=FeedForwardConfig(d_ff=40))))  # fmt: skip
    model = Transformer(cfg)
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (1, 3)
    assert model.encoder.layers[0].self_attn.n_heads == 2 and model.decoder.layers[0].self_attn.n_heads == 4
    assert model.decoder.layers[0].cross_attn.n_heads == 4  # cross-attention takes the decoder's heads
    assert (model.encoder.layers[0].ffn.up.out_features, model.decoder.layers[0].ffn.up.out_features) == (24, 40)
    with pytest.raises(QkvError, match=r"layers gives 2 blocks for n_layers=1"):
        StackConfig(n_layers=1, layers=(dense, dense))


def test_override_by_path_short_path_kind_and_flat_key() -> None:
    """Settings change by dotted path; a block's field sets every block; a word changes a part's kind, keeping the
    settings both kinds share; the flat keys of earlier versions still work."""
    base = DecoderLMConfig(vocab_size=10, d_model=32)
    full = base.override({"decoder.block.attention.n_kv_heads": 2})
    assert full == base.override({"attention.n_kv_heads": 2}) == base.override({"n_kv_heads": 2})
    mla = base.override({"attention.kv_lora_rank": 8, "attention": "mla", "positions": "rotary"})
    assert mla.decoder.block.attention == LatentAttentionConfig(n_heads=8, dropout=0.0, kv_lora_rank=8)
    every = base.override({"dropout": 0.3})  # the flat key: every dropout of the model
    assert {v for p, v in every.leaves() if p.endswith("dropout")} == {0.3}
    residual = base.override({"decoder.block.dropout": 0.3})
    assert [p for p, v in residual.leaves() if v == 0.3] == ["decoder.block.dropout"]
    layered = DecoderLMConfig(vocab_size=10, decoder=StackConfig(n_layers=2, layers=(BlockConfig(),)))
    assert layered.override({"norm": "rms"}).decoder.layers[0].norm.kind == "rms"  # every block, per-layer ones too
    with pytest.raises(QkvError, match=r"decoder.block has no field 'wings'"):
        base.override({"decoder.block.wings": 2})
    with pytest.raises(QkvError, match=r"unknown decoder.block.attention 'gqa'; choose one of: mha, mla"):
        base.override({"attention": "gqa"})


def test_dropouts_are_settings_of_their_own() -> None:
    """Each dropout reaches its module: the attention weights', the residual's, each in its own block."""
    cfg = TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=16).override({
        "dropout": 0.0, "attention.dropout": 0.25, "decoder.block.dropout": 0.1})  # fmt: skip
    model = Transformer(cfg)
    layer = model.decoder.layers[0]
    assert [layer.self_attn.dropout, layer.cross_attn.dropout] == [0.25, 0.25]  # type: ignore[union-attr]
    assert model.encoder.layers[0].self_attn.dropout == 0.25
    assert layer.ffn_residual.dropout.p == 0.1 and model.encoder.layers[0].ffn_residual.dropout.p == 0.0
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg


def _lm(**settings: Any) -> DecoderLMConfig:
    return DecoderLMConfig(vocab_size=10).override(settings)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: _lm(d_model=30, n_heads=4), r"decoder: n_heads=4 must divide d_model=30"),
        (lambda: _lm(n_kv_heads=3), r"n_kv_heads=3 must divide n_heads=8"),
        (lambda: _lm(norm="group"), r"kind must be one of layer, rms, batch, got 'group'"),
        (lambda: _lm(activation="tanh"), r"activation must be one of relu, gelu, gelu_tanh, swiglu, silu"),
        (lambda: _lm(positions="alibi"), r"unknown embedding.positions 'alibi'; choose one of: learned, "
                                         r"none, rotary, sinusoidal"),
        (lambda: _lm(dropout=-0.1), r"dropout must be in \[0, 1\), got -0.1"),
        (lambda: _lm(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (lambda: _lm(attention_dropout=1.5), r"decoder.block.attention: dropout must be in \[0, 1\), got 1.5"),
        (lambda: DecoderLMConfig(vocab_size=0), r"vocab_size must be a positive integer, got 0"),
        (lambda: DecoderLMConfig(vocab_size=-5), r"vocab_size must be a positive integer, got -5"),
        (lambda: _lm(n_layers=0), r"n_layers must be a positive integer"),
        (lambda: DecoderLMConfig(vocab_size=10, max_positions=0), r"max_positions must be a positive integer"),
        (lambda: _lm(d_model=12, n_heads=4, positions="rotary"), r"rotary positions need an even head dim"),
        (lambda: _lm(d_model=9, n_heads=3, positions="sinusoidal"), r"even d_model, got 9"),
        (lambda: TransformerConfig(src_vocab_size=10, tgt_vocab_size=12, share_embeddings=True),
         r"share_embeddings needs one vocabulary.*src_vocab_size=10.*tgt_vocab_size=12"),
        (lambda: TransformerConfig(src_vocab_size=0, tgt_vocab_size=12), r"src_vocab_size must be a positive"),
        (lambda: DecoderLMConfig.from_dict({"vocab_size": 10, "d_modle": 64, "heads": 2}),
         r"DecoderLMConfig has no field\(s\) d_modle, heads; its fields: d_model"),
        (lambda: TransformerConfig.from_dict({"src_vocab_size": 3, "foo": 1}), r"TransformerConfig has no field.*foo"),
        (lambda: DecoderLMConfig(vocab_size="ten"), r"vocab_size must be an integer or None, got 'ten'"),
        (lambda: EncoderConfig(vocab_size=10).override({"type_vocab_size": -1}), r"type_vocab_size must be ≥ 0"),
        (lambda: _lm(attention="mla"), r"attention kind mla needs rotary positions"),
    ],
)  # fmt: skip
def test_bad_configs(make: object, match: str) -> None:
    """Every invalid config is refused at construction with a message naming the field."""
    with pytest.raises(QkvError, match=match):
        make()  # type: ignore[operator]


# --------------------------------------------------------------------------------------------
# Bad model inputs
# --------------------------------------------------------------------------------------------


def test_decoder_lm_bad_inputs() -> None:
    """Too long, misshapen or mistyped inputs raise QkvError naming the problem; ids a user gives to generation are
    checked against the vocabulary there (a forward pass does not spend a check on every call)."""
    model = tiny_lm("learned")
    with pytest.raises(QkvError, match=r"reaches position 33 but the model has max_positions=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.new_cache()
    model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
    with pytest.raises(QkvError, match=r"reaches position 33 .*max_positions=32"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(QkvError, match=r"token id out of range \[0, 23\): got min 0, max 23"):
        generate(model, torch.tensor([[0, 23]]), 2)
    with pytest.raises(QkvError, match=r"token id out of range \[0, 23\): got min -1"):
        generate(model, torch.tensor([[-1, 2]]), 2)
    with pytest.raises(QkvError, match=r"token ids must have shape \(B, T\)"):
        model(torch.tensor([1, 2]))
    with pytest.raises(QkvError, match=r"token ids must be an integer tensor"):
        model(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(QkvError, match=r"padding_mask must be \(B, T_past \+ T\) = \(2, 4\), got \(2, 3\)"):
        model(torch.zeros(2, 4, dtype=torch.long), padding_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(QkvError, match=r"padding_mask must be"):
        model(torch.zeros(2, 4, dtype=torch.long), padding_mask=torch.ones(2, 1, 1, 4, dtype=torch.bool))


def test_transformer_bad_inputs() -> None:
    """The encoder–decoder model also refuses overlong sequences and mis-shaped masks."""
    model = tiny_transformer()
    with pytest.raises(QkvError, match=r"max_positions=32"):
        model.encode(torch.zeros(1, 40, dtype=torch.long))
    memory = model.encode(torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(QkvError, match=r"mask of shape"):
        model.decode(torch.ones(1, 2, dtype=torch.long), memory, src_mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))
