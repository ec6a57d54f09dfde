"""GPT-2 (Radford et al., 2019) ↔ qkv's DecoderLM.

GPT-2 is qkv's default decoder with these choices: learned absolute positions, pre-norm
LayerNorm (ε from layer_norm_epsilon), the tanh approximation of GELU ("gelu_new"), biases
everywhere, a final LayerNorm (ln_f) and an output head tied to the token embedding.
Its linear layers are `Conv1D`s, which store weights as (in, out) — the transpose of nn.Linear —
and its attention projects q, k and v with one fused matrix, c_attn = [W_q; W_k; W_v].
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
)
from qkv.models import DecoderLMConfig, EmbeddingConfig
from qkv.norms import NormConfig
from qkv.positional import LearnedPositionsConfig

NAME = "GPT-2"


def config_from_hf(hf: dict[str, Any], tensor_names: Collection[str]) -> DecoderLMConfig:
    """DecoderLMConfig for a GPT-2 config.json."""
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise unsupported(NAME, "scale_attn_by_inverse_layer_idx", True)
    if hf.get("scale_attn_weights") is False:
        raise unsupported(NAME, "scale_attn_weights", False)
    if hf.get("add_cross_attention"):
        raise unsupported(NAME, "add_cross_attention", True)
    d_model, dropout = hf_value(hf, "n_embd", NAME), hf_value(hf, "resid_pdrop", NAME, 0.1)
    activation = activation_from_hf(hf_value(hf, "activation_function", NAME, "gelu_new"), NAME)
    block = BlockConfig(
        attention=MultiHeadAttentionConfig(n_heads=hf_value(hf, "n_head", NAME),
                                           dropout=hf_value(hf, "attn_pdrop", NAME, 0.1)),
        ffn=FeedForwardConfig(d_ff=hf_value(hf, "n_inner", NAME, 4 * d_model), activation=activation,
                              dropout=dropout),  # as qkv always has: the residual's p on the hidden layer too
        norm=NormConfig(eps=hf_value(hf, "layer_norm_epsilon", NAME, 1e-5)),
        norm_placement="pre",
        dropout=dropout,
    )  # fmt: skip
    return DecoderLMConfig(
        vocab_size=hf_value(hf, "vocab_size", NAME),
        d_model=d_model,
        max_positions=hf_value(hf, "n_positions", NAME),
        embedding=EmbeddingConfig(dropout=hf_value(hf, "embd_pdrop", NAME, dropout)),
        decoder=StackConfig(n_layers=hf_value(hf, "n_layer", NAME), block=block, final_norm=True),
        tie_embeddings=hf_value(hf, "tie_word_embeddings", NAME, True),
    )


def name_map(cfg: DecoderLMConfig) -> NameMap:
    """Where each DecoderLM tensor lives in a GPT2LMHeadModel checkpoint."""
    refs: NameMap = {
        "embed.tokens.weight": Ref("transformer.wte.weight"),
        "embed.positions.weight": Ref("transformer.wpe.weight"),
        **norm("decoder.norm", "transformer.ln_f"),
        "lm_head.weight": Ref("transformer.wte.weight" if cfg.tie_embeddings else "lm_head.weight"),
    }
    for i in range(cfg.decoder.n_layers):
        q, h = f"decoder.layers.{i}", f"transformer.h.{i}"
        refs |= norm(f"{q}.self_residual.norm", f"{h}.ln_1")
        for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            refs |= linear(f"{q}.self_attn.{proj}", f"{h}.attn.c_attn", transposed=True, part=part, parts=3)
        refs |= linear(f"{q}.self_attn.out_proj", f"{h}.attn.c_proj", transposed=True)
        refs |= norm(f"{q}.ffn_residual.norm", f"{h}.ln_2")
        refs |= linear(f"{q}.ffn.up", f"{h}.mlp.c_fc", transposed=True)
        refs |= linear(f"{q}.ffn.down", f"{h}.mlp.c_proj", transposed=True)
    return refs


def export_problems(cfg: DecoderLMConfig) -> list[str]:
    """What keeps a DecoderLM config from being a GPT-2 (empty: it is one)."""
    problems = plain_stack_problems(cfg, "decoder")
    if problems:
        return problems
    block = cfg.decoder.block
    wanted = {"embedding.positions": LearnedPositionsConfig(), "embedding.scale": False, "embedding.norm": None,
              "embedding.type_vocab_size": 0, "decoder.block.norm.kind": "layer", "decoder.block.norm.bias": True,
              "decoder.block.norm_placement": "pre", "decoder.block.attention.bias": True,
              "decoder.block.ffn.bias": True}  # fmt: skip
    problems = mismatches(cfg, wanted)
    if not cfg.decoder.has_final_norm():
        problems.append("decoder.final_norm=False (needs a final norm)")
    if block.ffn.activation == "swiglu":
        problems.append("decoder.block.ffn.activation='swiglu' (needs gelu_tanh, gelu, relu or silu)")
    if kv_heads(block) != block.attention.n_heads:
        problems.append(f"decoder.block.attention.n_kv_heads={kv_heads(block)} (GPT-2 has one K/V head per query head)")
    return problems


def config_to_hf(cfg: DecoderLMConfig) -> dict[str, Any]:
    """config.json for a GPT2LMHeadModel with the DecoderLM's shape."""
    block = cfg.decoder.block
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_head": block.attention.n_heads,
        "n_layer": cfg.decoder.n_layers,
        "n_inner": block.ffn.width(cfg.d_model),
        "n_positions": cfg.max_positions,
        "activation_function": activation_to_hf(block.ffn.activation),
        "layer_norm_epsilon": block.norm.eps,
        "resid_pdrop": block.dropout,
        "embd_pdrop": cfg.embedding.dropout,
        "attn_pdrop": block.attention.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


FAMILY = Family(
    name=NAME,
    model_types=("gpt2",),
    config_from_hf=config_from_hf,
    name_map=name_map,
    aliases=(("transformer.", ""),),  # GPT2Model checkpoints (the original gpt2 upload) lack the prefix
    # attn.bias / attn.masked_bias: causal-mask buffers that older transformers saved; lm_head: a tied copy.
    ignored=(r"(^|\.)attn\.(masked_)?bias$", r"^lm_head\.weight$"),
    config_to_hf=config_to_hf,
    export_problems=export_problems,
)
