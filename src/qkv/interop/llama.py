"""Llama (Touvron et al., 2023) ↔ qkv's DecoderLM.

Llama is qkv's modern decoder recipe: rotary positions (base rope_theta, rotate-half pairing, as
qkv's RotaryEmbedding), pre-norm RMSNorm, a SwiGLU feed-forward (down(silu(gate(x)) · up(x))),
grouped-query attention (num_key_value_heads), no biases unless attention_bias/mlp_bias, and a
final RMSNorm. The layout is nn.Linear throughout, so every tensor maps one to one.
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
    hf_value,
    kv_heads,
    linear,
    mismatches,
    norm,
    plain_stack_problems,
    unsupported,
)
from qkv.models import DecoderLMConfig, EmbeddingConfig
from qkv.norms import NormConfig
from qkv.positional import RotaryPositionsConfig

NAME = "Llama"


def _rope_theta(hf: dict[str, Any]) -> float:
    """The rotary base; only plain RoPE is supported (no llama3/yarn/dynamic scaling)."""
    # transformers ≥ 5 writes rope_parameters; earlier versions (and most hub checkpoints) rope_theta/rope_scaling.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise unsupported(NAME, "rope_type", rope_type)
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict[str, Any], tensor_names: Collection[str]) -> DecoderLMConfig:
    """DecoderLMConfig for a Llama config.json."""
    if hf_value(hf, "hidden_act", NAME, "silu") != "silu":
        raise unsupported(NAME, "hidden_act", hf["hidden_act"])
    d_model, n_heads = hf_value(hf, "hidden_size", NAME), hf_value(hf, "num_attention_heads", NAME)
    head_dim = hf_value(hf, "head_dim", NAME, d_model // n_heads)
    if head_dim * n_heads != d_model:  # qkv's heads split d_model evenly
        raise unsupported(NAME, "head_dim", head_dim)
    attention_bias, kv_heads = bool(hf.get("attention_bias", False)), hf_value(hf, "num_key_value_heads", NAME, n_heads)
    block = BlockConfig(
        attention=MultiHeadAttentionConfig(n_heads=n_heads, n_kv_heads=kv_heads, bias=attention_bias,
                                           dropout=hf_value(hf, "attention_dropout", NAME, 0.0)),
        ffn=FeedForwardConfig(d_ff=hf_value(hf, "intermediate_size", NAME), activation="swiglu",
                              bias=bool(hf.get("mlp_bias", False)), dropout=0.0),
        norm=NormConfig(kind="rms", eps=hf_value(hf, "rms_norm_eps", NAME, 1e-6), bias=attention_bias),
        norm_placement="pre",
        dropout=0.0,  # Llama has no residual or embedding dropout
    )  # fmt: skip
    return DecoderLMConfig(
        vocab_size=hf_value(hf, "vocab_size", NAME),
        d_model=d_model,
        max_positions=hf_value(hf, "max_position_embeddings", NAME),
        embedding=EmbeddingConfig(positions=RotaryPositionsConfig(base=_rope_theta(hf)), dropout=0.0),
        decoder=StackConfig(n_layers=hf_value(hf, "num_hidden_layers", NAME), block=block, final_norm=True),
        tie_embeddings=hf_value(hf, "tie_word_embeddings", NAME, False),
    )


def shell_name_map(cfg: DecoderLMConfig) -> NameMap:
    """Token embedding, final norm and output head, named as in Llama-style checkpoints (Llama, DeepSeek)."""
    return {
        "embed.tokens.weight": Ref("model.embed_tokens.weight"),
        **norm("decoder.norm", "model.norm", bias=False),
        "lm_head.weight": Ref("model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"),
    }


def name_map(cfg: DecoderLMConfig) -> NameMap:
    """Where each DecoderLM tensor lives in a LlamaForCausalLM checkpoint."""
    refs = shell_name_map(cfg)
    for i, block in enumerate(cfg.decoder.blocks()):
        q, h = f"decoder.layers.{i}", f"model.layers.{i}"
        attention_bias, mlp_bias = block.attention.bias, block.ffn.bias
        refs |= norm(f"{q}.self_residual.norm", f"{h}.input_layernorm", bias=False)
        for proj in ("q_proj", "k_proj", "v_proj"):
            refs |= linear(f"{q}.self_attn.{proj}", f"{h}.self_attn.{proj}", attention_bias)
        refs |= linear(f"{q}.self_attn.out_proj", f"{h}.self_attn.o_proj", attention_bias)
        refs |= norm(f"{q}.ffn_residual.norm", f"{h}.post_attention_layernorm", bias=False)
        refs |= linear(f"{q}.ffn.gate", f"{h}.mlp.gate_proj", mlp_bias)
        refs |= linear(f"{q}.ffn.up", f"{h}.mlp.up_proj", mlp_bias)
        refs |= linear(f"{q}.ffn.down", f"{h}.mlp.down_proj", mlp_bias)
    return refs


def export_problems(cfg: DecoderLMConfig) -> list[str]:
    """What keeps a DecoderLM config from being a Llama (empty: it is one)."""
    problems = plain_stack_problems(cfg, "decoder")
    if problems:
        return problems
    wanted = {"embedding.positions.kind": "rotary", "decoder.block.norm.kind": "rms",
              "decoder.block.norm_placement": "pre", "decoder.block.ffn.activation": "swiglu",
              "embedding.scale": False, "embedding.norm": None, "embedding.type_vocab_size": 0}  # fmt: skip
    problems = mismatches(cfg, wanted)
    if not cfg.decoder.has_final_norm():
        problems.append("decoder.final_norm=False (needs a final norm)")
    return problems


def config_to_hf(cfg: DecoderLMConfig) -> dict[str, Any]:
    """config.json for a LlamaForCausalLM with the DecoderLM's shape."""
    block, rope_base = cfg.decoder.block, float(getattr(cfg.embedding.positions, "base", 10000.0))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_attention_heads": block.attention.n_heads,
        "num_key_value_heads": kv_heads(block),
        "head_dim": block.attention.head_dim(cfg.d_model),
        "num_hidden_layers": cfg.decoder.n_layers,
        "intermediate_size": block.ffn.width(cfg.d_model),
        "max_position_embeddings": cfg.max_positions,
        "hidden_act": "silu",
        "rms_norm_eps": block.norm.eps,
        # Both spellings: transformers ≥ 5 reads rope_parameters, 4.x reads rope_theta.
        "rope_theta": rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_base},
        "attention_bias": block.attention.bias,
        "mlp_bias": block.ffn.bias,
        "attention_dropout": block.attention.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


FAMILY = Family(
    name=NAME,
    model_types=("llama",),
    config_from_hf=config_from_hf,
    name_map=name_map,
    aliases=(("model.", ""),),  # LlamaModel checkpoints lack the "model." prefix
    ignored=(r"rotary_emb\.inv_freq$", r"^lm_head\.weight$"),  # a recomputed buffer; a tied copy
    config_to_hf=config_to_hf,
    export_problems=export_problems,
)
