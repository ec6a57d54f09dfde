"""BART (Lewis et al., 2020) → qkv's encoder–decoder Transformer.

BART is the paper's Transformer with these choices: learned positions whose table starts 2 rows
late (a fairseq leftover: position p reads row p + 2), a LayerNorm over the embeddings on both
sides (layernorm_embedding), post-norm LayerNorms (ε 1e-5), GELU, token embeddings scaled by
√d_model only when scale_embedding is set, one vocabulary shared by encoder, decoder and the tied
output head, and an output bias (final_logits_bias).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from qkv.attention import MultiHeadAttentionConfig
from qkv.blocks import BlockConfig, FeedForwardConfig, StackConfig
from qkv.interop.hf_io import (
    Family,
    NameMap,
    Ref,
    activation_from_hf,
    activation_to_hf,
    hf_value,
    kv_heads,
    linear,
    mismatches,
    norm,
    plain_stack_problems,
    unsupported,
    value_at,
)
from qkv.models import EmbeddingConfig, TransformerConfig
from qkv.norms import NormConfig
from qkv.positional import LearnedPositionsConfig, PositionsConfig

NAME = "BART"
POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding.offset


def _side(hf: dict[str, Any], side: str, name: str) -> StackConfig:
    """One side's stack: its own depth, heads and feed-forward width (encoder_* or decoder_* in config.json)."""
    block = BlockConfig(
        attention=MultiHeadAttentionConfig(n_heads=hf_value(hf, f"{side}_attention_heads", name),
                                           dropout=hf_value(hf, "attention_dropout", name, 0.0)),
        # qkv drops the feed-forward's hidden layer with the residual's p (transformers: activation_dropout)
        ffn=FeedForwardConfig(d_ff=hf_value(hf, f"{side}_ffn_dim", name), dropout=hf_value(hf, "dropout",
                              name, 0.1), activation=activation_from_hf(hf_value(hf, "activation_function", name,
                              "gelu"), name)),
        norm=NormConfig(eps=1e-5),  # nn.LayerNorm's default: neither config has an ε
        norm_placement="post",
        dropout=hf_value(hf, "dropout", name, 0.1),
    )  # fmt: skip
    return StackConfig(n_layers=hf_value(hf, f"{side}_layers", name), block=block, final_norm=False)


def seq2seq_config(hf: dict[str, Any], name: str, positions: PositionsConfig, embedding_norm: bool,
                   pad_id: int) -> TransformerConfig:  # fmt: skip
    """The TransformerConfig BART and Marian spell alike (post-norm, biases, one shared vocabulary, an output bias,
    each side its own shape); the family gives the positions, the embeddings' norm and the pad id."""
    vocab_size = hf_value(hf, "vocab_size", name)
    embedding = EmbeddingConfig(positions=positions, scale=hf_value(hf, "scale_embedding", name, False),
                                norm=NormConfig(eps=1e-5) if embedding_norm else None,
                                dropout=hf_value(hf, "dropout", name, 0.1))  # fmt: skip
    return TransformerConfig(
        src_vocab_size=vocab_size,
        tgt_vocab_size=vocab_size,
        d_model=hf_value(hf, "d_model", name),
        max_positions=hf_value(hf, "max_position_embeddings", name),
        embedding=embedding,
        encoder=_side(hf, "encoder", name),
        decoder=_side(hf, "decoder", name),
        share_embeddings=True,
        tie_embeddings=hf_value(hf, "tie_word_embeddings", name, True),
        pad_id=pad_id,
        output_bias=True,
    )


def config_from_hf(hf: dict[str, Any], tensor_names: Collection[str]) -> TransformerConfig:
    """TransformerConfig for a BART config.json."""
    for flag in ("normalize_before", "add_final_layer_norm"):  # mBART-style pre-norm variants
        if hf.get(flag):
            raise unsupported(NAME, flag, True)
    return seq2seq_config(hf, NAME, LearnedPositionsConfig(offset=POSITION_OFFSET), embedding_norm=True,
                          pad_id=hf_value(hf, "pad_token_id", NAME, 1))  # fmt: skip


def _attention(qkv: str, hf: str) -> NameMap:
    """The four projections, which BART names as qkv does."""
    refs: NameMap = {}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        refs |= linear(f"{qkv}.{proj}", f"{hf}.{proj}")
    return refs


def seq2seq_name_map(cfg: TransformerConfig) -> NameMap:
    """The tensors BART and Marian name alike: the shared embedding, the output layer and every layer."""
    refs: NameMap = {
        "src_embed.tokens.weight": Ref("model.shared.weight"),
        "tgt_embed.tokens.weight": Ref("model.shared.weight"),
        "generator.weight": Ref("model.shared.weight" if cfg.tie_embeddings else "lm_head.weight"),
        "generator.bias": Ref("final_logits_bias", row=True, optional=True),  # transformers zero-fills it too
    }
    for i in range(cfg.encoder.n_layers):
        q, h = f"encoder.layers.{i}", f"model.encoder.layers.{i}"
        refs |= _attention(f"{q}.self_attn", f"{h}.self_attn")
        refs |= norm(f"{q}.attn_residual.norm", f"{h}.self_attn_layer_norm")
        refs |= linear(f"{q}.ffn.up", f"{h}.fc1") | linear(f"{q}.ffn.down", f"{h}.fc2")
        refs |= norm(f"{q}.ffn_residual.norm", f"{h}.final_layer_norm")
    for i in range(cfg.decoder.n_layers):
        q, h = f"decoder.layers.{i}", f"model.decoder.layers.{i}"
        refs |= _attention(f"{q}.self_attn", f"{h}.self_attn")
        refs |= norm(f"{q}.self_residual.norm", f"{h}.self_attn_layer_norm")
        refs |= _attention(f"{q}.cross_attn", f"{h}.encoder_attn")
        refs |= norm(f"{q}.cross_residual.norm", f"{h}.encoder_attn_layer_norm")
        refs |= linear(f"{q}.ffn.up", f"{h}.fc1") | linear(f"{q}.ffn.down", f"{h}.fc2")
        refs |= norm(f"{q}.ffn_residual.norm", f"{h}.final_layer_norm")
    return refs


def name_map(cfg: TransformerConfig) -> NameMap:
    """Where each Transformer tensor lives in a BartForConditionalGeneration checkpoint."""
    refs = seq2seq_name_map(cfg)
    for side, q_side in (("encoder", "src_embed"), ("decoder", "tgt_embed")):
        refs[f"{q_side}.positions.weight"] = Ref(f"model.{side}.embed_positions.weight")
        refs |= norm(f"{q_side}.norm", f"model.{side}.layernorm_embedding")
    return refs


def seq2seq_export_problems(cfg: TransformerConfig) -> list[str]:
    """What keeps a Transformer from BART's and Marian's shared shape: post-norm LayerNorm blocks with biases and
    multi-head attention on each side, and what config.json says once for both sides (dropouts, activation)."""
    problems: list[str] = []
    for side in cfg.stacks:
        problems += plain_stack_problems(cfg, side)
    if problems:
        return problems
    wanted: dict[str, object] = {"share_embeddings": True, "embedding.type_vocab_size": 0}
    for side in cfg.stacks:
        wanted |= {f"{side}.block.norm.kind": "layer", f"{side}.block.norm.eps": 1e-5, f"{side}.block.norm.bias": True,
                   f"{side}.block.norm_placement": "post", f"{side}.block.attention.bias": True,
                   f"{side}.block.ffn.bias": True}  # fmt: skip
    problems = mismatches(cfg, wanted)
    for side in cfg.stacks:
        block = cfg.stack(side).block
        if cfg.stack(side).has_final_norm():
            problems.append(f"{side}.final_norm=True (needs none: BART and Marian end each side with the last block)")
        if block.ffn.activation == "swiglu":
            problems.append(f"{side}.block.ffn.activation='swiglu' (needs silu, relu, gelu or gelu_tanh)")
        if kv_heads(block) != block.attention.n_heads:
            problems.append(f"{side}.block.attention.n_kv_heads={kv_heads(block)} (one K/V head per query head)")
    for what in ("dropout", "attention.dropout", "ffn.dropout", "ffn.activation"):  # one value in config.json
        values = {value_at(cfg.encoder.block, what), value_at(cfg.decoder.block, what)}
        if len(values) > 1:
            problems.append(f"encoder and decoder {what} differ ({', '.join(map(str, values))}; needs one)")
    return problems


def side_to_hf(cfg: TransformerConfig, silu: str = "silu") -> dict[str, object]:
    """config.json's per-side shapes and the settings both sides share (`silu`: the family's name for SiLU)."""
    out: dict[str, object] = {}
    for side in cfg.stacks:
        stack = cfg.stack(side)
        out |= {f"{side}_layers": stack.n_layers, f"{side}_attention_heads": stack.block.attention.n_heads,
                f"{side}_ffn_dim": stack.block.ffn.width(cfg.d_model)}  # fmt: skip
    block = cfg.decoder.block
    activation = silu if block.ffn.activation == "silu" else activation_to_hf(block.ffn.activation)
    return out | {"activation_function": activation, "dropout": block.dropout, "attention_dropout":
                  block.attention.dropout, "activation_dropout": block.ffn.dropout}  # fmt: skip


def export_problems(cfg: TransformerConfig) -> list[str]:
    """What keeps a Transformer config from being a BART (empty: it is one)."""
    return seq2seq_export_problems(cfg) + mismatches(cfg, {
        "embedding.positions": LearnedPositionsConfig(offset=POSITION_OFFSET), "embedding.norm": NormConfig(eps=1e-5)})


def config_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    """config.json for a BartForConditionalGeneration with the Transformer's shape (token ids added by the caller)."""
    return {
        "model_type": "bart",
        "architectures": ["BartForConditionalGeneration"],
        "vocab_size": cfg.src_vocab_size,
        "d_model": cfg.d_model,
        **side_to_hf(cfg),
        "max_position_embeddings": cfg.max_positions,
        "scale_embedding": cfg.embedding.scale,
        "normalize_before": False,
        "add_final_layer_norm": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "is_encoder_decoder": True,
        "pad_token_id": cfg.pad_id,
    }


FAMILY = Family(
    name=NAME,
    model_types=("bart",),
    config_from_hf=config_from_hf,
    name_map=name_map,
    aliases=(("model.", ""),),  # BartModel checkpoints lack the "model." prefix
    ignored=(r"(^|\.)(encoder|decoder)\.embed_tokens\.weight$", r"^lm_head\.weight$"),  # tied copies of shared
    config_to_hf=config_to_hf,
    export_problems=export_problems,
    exports="transformer",
)
