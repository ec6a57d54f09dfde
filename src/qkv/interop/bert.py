"""BERT (Devlin et al., 2019) → qkv's EncoderModel.

BERT is qkv's encoder with these choices: post-norm LayerNorm (ε = layer_norm_eps, 1e-12 in
the originals), learned absolute positions, token-type (segment) embeddings, a LayerNorm over
the summed embeddings, exact (erf) GELU, and a tanh pooler over the [CLS] token when the
checkpoint has one (sentence-embedding models such as all-MiniLM-L6-v2 keep it but do not use it).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from qkv.attention import MultiHeadAttentionConfig
from qkv.blocks import BlockConfig, FeedForwardConfig, StackConfig
from qkv.interop.hf_io import Family, NameMap, Ref, activation_from_hf, hf_value, linear, norm, unsupported
from qkv.models import EmbeddingConfig, EncoderConfig
from qkv.norms import NormConfig

NAME = "BERT"


def config_from_hf(hf: dict[str, Any], tensor_names: Collection[str]) -> EncoderConfig:
    """EncoderConfig for a BERT config.json; the pooler is kept when the checkpoint has its weights."""
    position_type = hf_value(hf, "position_embedding_type", NAME, "absolute")
    if position_type != "absolute":
        raise unsupported(NAME, "position_embedding_type", position_type)
    for flag in ("is_decoder", "add_cross_attention"):
        if hf.get(flag):
            raise unsupported(NAME, flag, True)
    dropout, norm_cfg = hf_value(hf, "hidden_dropout_prob", NAME, 0.1), NormConfig(eps=hf_value(hf, "layer_norm_eps",
                                                                                                 NAME, 1e-12))
    block = BlockConfig(
        attention=MultiHeadAttentionConfig(n_heads=hf_value(hf, "num_attention_heads", NAME),
                                           dropout=hf_value(hf, "attention_probs_dropout_prob", NAME, 0.1)),
        ffn=FeedForwardConfig(d_ff=hf_value(hf, "intermediate_size", NAME), dropout=dropout,
                              activation=activation_from_hf(hf_value(hf, "hidden_act", NAME, "gelu"), NAME)),
        norm=norm_cfg,
        norm_placement="post",
        dropout=dropout,
    )  # fmt: skip
    return EncoderConfig(
        vocab_size=hf_value(hf, "vocab_size", NAME),
        d_model=hf_value(hf, "hidden_size", NAME),
        max_positions=hf_value(hf, "max_position_embeddings", NAME),
        embedding=EmbeddingConfig(norm=norm_cfg, type_vocab_size=hf_value(hf, "type_vocab_size", NAME, 2),
                                  dropout=dropout),
        encoder=StackConfig(n_layers=hf_value(hf, "num_hidden_layers", NAME), block=block, final_norm=False),
        pooler=any(name.endswith("pooler.dense.weight") for name in tensor_names),
    )


def name_map(cfg: EncoderConfig) -> NameMap:
    """Where each EncoderModel tensor lives in a BertModel checkpoint."""
    refs: NameMap = {
        "embed.tokens.weight": Ref("embeddings.word_embeddings.weight"),
        "embed.positions.weight": Ref("embeddings.position_embeddings.weight"),
        **norm("embed.norm", "embeddings.LayerNorm"),
    }
    if cfg.embedding.type_vocab_size > 0:
        refs["embed.token_types.weight"] = Ref("embeddings.token_type_embeddings.weight")
    if cfg.pooler:
        refs |= linear("pooler", "pooler.dense")
    for i in range(cfg.encoder.n_layers):
        q, h = f"encoder.layers.{i}", f"encoder.layer.{i}"
        for proj, hf_proj in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            refs |= linear(f"{q}.self_attn.{proj}", f"{h}.attention.self.{hf_proj}")
        refs |= linear(f"{q}.self_attn.out_proj", f"{h}.attention.output.dense")
        refs |= norm(f"{q}.attn_residual.norm", f"{h}.attention.output.LayerNorm")
        refs |= linear(f"{q}.ffn.up", f"{h}.intermediate.dense")
        refs |= linear(f"{q}.ffn.down", f"{h}.output.dense")
        refs |= norm(f"{q}.ffn_residual.norm", f"{h}.output.LayerNorm")
    return refs


FAMILY = Family(
    name=NAME,
    model_types=("bert",),
    config_from_hf=config_from_hf,
    name_map=name_map,
    aliases=(("", "bert."),),  # BertFor… task models keep the encoder under "bert."
    ignored=(r"embeddings\.position_ids$", r"^cls\."),  # an arange buffer; the pre-training heads
)
