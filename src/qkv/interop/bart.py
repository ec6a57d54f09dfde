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

from qkv.config import TransformerConfig
from qkv.interop.hf_io import Family, NameMap, Ref, activation_from_hf, hf_value, linear, norm, unsupported

NAME = "BART"
POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding.offset


def _same(hf: dict[str, Any], encoder_key: str, decoder_key: str, name: str) -> int:
    """A size that qkv's one block config gives both sides, refusing checkpoints where they differ."""
    enc, dec = hf_value(hf, encoder_key, name), hf_value(hf, decoder_key, name)
    if enc != dec:
        raise unsupported(name, f"{encoder_key}≠{decoder_key}", (enc, dec))
    return int(enc)


def seq2seq_config(hf: dict[str, Any], name: str, **family: Any) -> TransformerConfig:
    """The TransformerConfig fields BART and Marian spell alike (post-norm, biases, one shared vocabulary, an
    output bias); `family` gives the rest (positions, norms, pad id)."""
    vocab_size = hf_value(hf, "vocab_size", name)
    return TransformerConfig(
        src_vocab_size=vocab_size,
        tgt_vocab_size=vocab_size,
        d_model=hf_value(hf, "d_model", name),
        n_heads=_same(hf, "encoder_attention_heads", "decoder_attention_heads", name),
        d_ff=_same(hf, "encoder_ffn_dim", "decoder_ffn_dim", name),
        n_encoder_layers=hf_value(hf, "encoder_layers", name),
        n_decoder_layers=hf_value(hf, "decoder_layers", name),
        max_positions=hf_value(hf, "max_position_embeddings", name),
        norm="layer",
        norm_placement="post",
        norm_eps=1e-5,  # nn.LayerNorm's default: neither config has an ε
        activation=activation_from_hf(hf_value(hf, "activation_function", name, "gelu"), name),
        bias=True,
        dropout=hf_value(hf, "dropout", name, 0.1),
        attention_dropout=hf_value(hf, "attention_dropout", name, 0.0),
        share_embeddings=True,
        tie_embeddings=hf_value(hf, "tie_word_embeddings", name, True),
        scale_embeddings=hf_value(hf, "scale_embedding", name, False),
        output_bias=True,
        **family,
    )


def config_from_hf(hf: dict[str, Any], tensor_names: Collection[str]) -> TransformerConfig:
    """TransformerConfig for a BART config.json."""
    for flag in ("normalize_before", "add_final_layer_norm"):  # mBART-style pre-norm variants
        if hf.get(flag):
            raise unsupported(NAME, flag, True)
    return seq2seq_config(hf, NAME, positions="learned", position_offset=POSITION_OFFSET, embedding_norm=True,
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
    for i in range(cfg.n_encoder_layers):
        q, h = f"encoder.layers.{i}", f"model.encoder.layers.{i}"
        refs |= _attention(f"{q}.self_attn", f"{h}.self_attn")
        refs |= norm(f"{q}.attn_residual.norm", f"{h}.self_attn_layer_norm")
        refs |= linear(f"{q}.ffn.up", f"{h}.fc1") | linear(f"{q}.ffn.down", f"{h}.fc2")
        refs |= norm(f"{q}.ffn_residual.norm", f"{h}.final_layer_norm")
    for i in range(cfg.n_decoder_layers):
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


FAMILY = Family(
    name=NAME,
    model_types=("bart",),
    config_from_hf=config_from_hf,
    name_map=name_map,
    aliases=(("model.", ""),),  # BartModel checkpoints lack the "model." prefix
    ignored=(r"(^|\.)(encoder|decoder)\.embed_tokens\.weight$", r"^lm_head\.weight$"),  # tied copies of shared
)
