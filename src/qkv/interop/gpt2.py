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

from qkv.config import DecoderLMConfig
from qkv.interop.hf_io import (
    Family,
    NameMap,
    Ref,
    activation_from_hf,
    activation_to_hf,
    hf_value,
    linear,
    norm,
    plain_block_problems,
    unsupported,
)

NAME = "GPT-2"


def config_from_hf(hf: dict[str, Any], tensor_names: Collection[str]) -> DecoderLMConfig:
    """DecoderLMConfig for a GPT-2 config.json."""
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise unsupported(NAME, "scale_attn_by_inverse_layer_idx", True)
    if hf.get("scale_attn_weights") is False:
        raise unsupported(NAME, "scale_attn_weights", False)
    if hf.get("add_cross_attention"):
        raise unsupported(NAME, "add_cross_attention", True)
    d_model = hf_value(hf, "n_embd", NAME)
    return DecoderLMConfig(
        vocab_size=hf_value(hf, "vocab_size", NAME),
        d_model=d_model,
        n_heads=hf_value(hf, "n_head", NAME),
        n_layers=hf_value(hf, "n_layer", NAME),
        d_ff=hf_value(hf, "n_inner", NAME, 4 * d_model),
        max_positions=hf_value(hf, "n_positions", NAME),
        positions="learned",
        norm="layer",
        norm_placement="pre",
        norm_eps=hf_value(hf, "layer_norm_epsilon", NAME, 1e-5),
        activation=activation_from_hf(hf_value(hf, "activation_function", NAME, "gelu_new"), NAME),
        bias=True,
        dropout=hf_value(hf, "resid_pdrop", NAME, 0.1),
        attention_dropout=hf_value(hf, "attn_pdrop", NAME, 0.1),
        tie_embeddings=hf_value(hf, "tie_word_embeddings", NAME, True),
        final_norm=True,
    )


def name_map(cfg: DecoderLMConfig) -> NameMap:
    """Where each DecoderLM tensor lives in a GPT2LMHeadModel checkpoint."""
    refs: NameMap = {
        "embed.tokens.weight": Ref("transformer.wte.weight"),
        "embed.positions.weight": Ref("transformer.wpe.weight"),
        **norm("decoder.norm", "transformer.ln_f"),
        "lm_head.weight": Ref("transformer.wte.weight" if cfg.tie_embeddings else "lm_head.weight"),
    }
    for i in range(cfg.n_layers):
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
    wanted = {"positions": "learned", "norm": "layer", "norm_placement": "pre", "bias": True, "final_norm": True}
    problems = [f"{k}={getattr(cfg, k)!r} (needs {v!r})" for k, v in wanted.items() if getattr(cfg, k) != v]
    problems += plain_block_problems(cfg)
    if cfg.activation == "swiglu":
        problems.append("activation='swiglu' (needs gelu_tanh, gelu, relu or silu)")
    if cfg.n_kv_heads not in (None, cfg.n_heads):
        problems.append(f"n_kv_heads={cfg.n_kv_heads} (GPT-2 has one K/V head per query head)")
    for flag in ("scale_embeddings", "embedding_norm"):
        if getattr(cfg, flag):
            problems.append(f"{flag}=True")
    if cfg.position_offset:
        problems.append(f"position_offset={cfg.position_offset} (GPT-2's position table starts at 0)")
    return problems


def config_to_hf(cfg: DecoderLMConfig) -> dict[str, Any]:
    """config.json for a GPT2LMHeadModel with the DecoderLM's shape."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_head": cfg.n_heads,
        "n_layer": cfg.n_layers,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.max_positions,
        "activation_function": activation_to_hf(cfg.activation),
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attn_dropout,
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
