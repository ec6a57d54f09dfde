"""Flat model configs, as runs and `qkv convert` directories wrote them before component configs, in today's
nested layout; and the flat keys (`--model n_kv_heads=2`) as the nested paths they now stand for.

A flat config held one block's settings beside the model's (d_model, n_heads, n_kv_heads, d_ff, dropout,
attention_dropout, bias, activation, norm, norm_placement, norm_eps, attention, the MLA and MoE fields, positions,
…). Today each part has its own config: an attention, a feed-forward, a norm per block; a stack per side; an
embedding with its positions. Only dicts are handled here: qkv.models builds the configs from what this returns.
"""

from __future__ import annotations

from typing import Any

from qkv.errors import QkvError

# A flat key → the paths it sets today, each as a model config's shorthand (qkv.models.ModelConfig.expand: a
# block's field sets it in every stack's blocks, a stack's in every stack).
KEYS: dict[str, tuple[str, ...]] = {
    "n_heads": ("attention.n_heads",),
    "n_kv_heads": ("attention.n_kv_heads",),
    "d_ff": ("ffn.d_ff",),
    "activation": ("ffn.activation",),
    "bias": ("attention.bias", "ffn.bias", "norm.bias", "embedding.norm.bias"),
    "dropout": ("dropout", "attention.dropout", "ffn.dropout", "embedding.dropout"),
    "attention_dropout": ("attention.dropout",),
    "norm": ("norm.kind", "embedding.norm.kind"),  # (the embeddings' norm only where there is one)
    "norm_eps": ("norm.eps", "embedding.norm.eps"),
    "kv_lora_rank": ("attention.kv_lora_rank",),
    "q_lora_rank": ("attention.q_lora_rank",),
    "qk_nope_head_dim": ("attention.qk_nope_head_dim",),
    "qk_rope_head_dim": ("attention.qk_rope_head_dim",),
    "v_head_dim": ("attention.v_head_dim",),
    "mla_absorb": ("attention.absorb",),
    "moe_top_k": ("ffn.top_k",),
    "moe_shared_experts": ("ffn.shared_experts",),
    "moe_d_ff": ("ffn.d_ff",),
    "moe_groups": ("ffn.groups",),
    "moe_topk_groups": ("ffn.topk_groups",),
    "moe_norm_topk": ("ffn.norm_topk",),
    "moe_scale": ("ffn.scale",),
    "n_encoder_layers": ("encoder.n_layers",),
    "n_decoder_layers": ("decoder.n_layers",),
    "positions": ("embedding.positions",),
    "sinusoid_layout": ("embedding.positions.layout",),
    "rope_base": ("embedding.positions.base",),
    "position_offset": ("embedding.positions.offset",),
    "scale_embeddings": ("embedding.scale",),
    "type_vocab_size": ("embedding.type_vocab_size",),
}
# Flat keys with no one path today, and what to set instead.
REPLACED = {
    "moe_first_dense": "give the first layers blocks of their own: decoder.layers (a list of block configs)",
}


def setting(key: str, value: Any) -> dict[str, Any]:
    """A flat key's setting as {shorthand path: value}; {} for a key that is not a flat one."""
    if key == "moe_experts":  # experts > 0 makes every feed-forward a mixture
        return {"ffn": "moe", "ffn.experts": value} if value else {"ffn": "dense"}
    if key in REPLACED:
        raise QkvError(f"--model {key} is no longer a setting: {REPLACED[key]}")
    return dict.fromkeys(KEYS.get(key, ()), value)


def model(model_type: str, flat: dict[str, Any]) -> dict[str, Any]:
    """A whole flat model config (config.json's "model", every field present) as today's nested dict."""
    f = flat
    block, layers = _block(f), []
    if f.get("moe_experts"):  # the first moe_first_dense layers kept their dense feed-forward
        layers = [block] * int(f.get("moe_first_dense") or 0)
        block = {**block, "ffn": _moe(f)}
    side = {"block": block, "layers": layers, "final_norm": f.get("final_norm")}
    common = {"d_model": f["d_model"], "max_positions": f["max_positions"], "embedding": _embedding(f)}
    if model_type == "decoder_lm":
        return {"vocab_size": f["vocab_size"], **common, "decoder": {"n_layers": f["n_layers"], **side},
                "tie_embeddings": f["tie_embeddings"]}  # fmt: skip
    if model_type == "encoder":
        return {"vocab_size": f["vocab_size"], **common, "encoder": {"n_layers": f["n_layers"], **side},
                "tie_embeddings": f["tie_embeddings"], "pooler": f["pooler"], "mlm_head": f["mlm_head"]}  # fmt: skip
    return {"src_vocab_size": f["src_vocab_size"], "tgt_vocab_size": f["tgt_vocab_size"], **common,
            "encoder": {"n_layers": f["n_encoder_layers"], **side},
            "decoder": {"n_layers": f["n_decoder_layers"], **side}, "share_embeddings": f["share_embeddings"],
            "tie_embeddings": f["tie_embeddings"], "pad_id": f["pad_id"], "output_bias": f["output_bias"]}  # fmt: skip


def is_flat(data: dict[str, Any]) -> bool:
    """Whether a model config dict is in the flat layout (it has no stack of layers)."""
    return "n_heads" in data and not any(side in data for side in ("decoder", "encoder"))


def _norm(f: dict[str, Any]) -> dict[str, Any]:
    """The one norm every flat config used (blocks, the final norm, the embeddings' norm)."""
    return {"kind": f["norm"], "eps": f["norm_eps"], "bias": f["bias"]}


def _block(f: dict[str, Any]) -> dict[str, Any]:
    """A flat config's block (with a dense feed-forward)."""
    attn_dropout = f["dropout"] if f.get("attention_dropout") is None else f["attention_dropout"]
    attention: dict[str, Any] = {"n_heads": f["n_heads"], "bias": f["bias"], "dropout": attn_dropout}
    if f.get("attention", "mha") == "mla":
        mla = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        attention = {"kind": "mla", **attention, **{k: f[k] for k in mla}, "absorb": f.get("mla_absorb", False)}
    else:
        attention = {"kind": "mha", **attention, "n_kv_heads": f.get("n_kv_heads")}
    ffn = {"kind": "dense", "d_ff": f["d_ff"], "activation": f["activation"], "bias": f["bias"],
           "dropout": f["dropout"]}
    return {"attention": attention, "ffn": ffn, "norm": _norm(f), "norm_placement": f["norm_placement"],
            "dropout": f["dropout"]}  # fmt: skip


def _moe(f: dict[str, Any]) -> dict[str, Any]:
    """A flat config's mixture of experts."""
    return {"kind": "moe", "d_ff": f.get("moe_d_ff") or f["d_ff"], "activation": f["activation"], "bias": f["bias"],
            "dropout": f["dropout"], "experts": f["moe_experts"], "top_k": f["moe_top_k"],
            "shared_experts": f["moe_shared_experts"], "groups": f["moe_groups"], "topk_groups": f["moe_topk_groups"],
            "norm_topk": f["moe_norm_topk"], "scale": f["moe_scale"]}  # fmt: skip


def _embedding(f: dict[str, Any]) -> dict[str, Any]:
    """A flat config's embedding: its positions, scale, norm, token types and dropout."""
    kind = f["positions"]
    positions: dict[str, Any] = {"kind": kind}
    if kind == "learned":
        positions["offset"] = f.get("position_offset", 0)
    elif kind == "sinusoidal":
        positions["layout"] = f.get("sinusoid_layout", "interleaved")
    elif kind == "rotary":
        positions["base"] = f.get("rope_base", 10000.0)
    return {"positions": positions, "scale": f["scale_embeddings"], "norm": _norm(f) if f["embedding_norm"] else None,
            "type_vocab_size": f.get("type_vocab_size", 0), "dropout": f["dropout"]}  # fmt: skip
