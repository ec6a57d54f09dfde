"""DeepSeek-V3 (Hugging Face `deepseek_v3`) checkpoints → a qkv DecoderLM with MLA and mixture-of-experts layers.

The architecture maps onto qkv blocks one to one: pre-norm RMSNorm layers, MLA self-attention
(qkv.attention.latent), SwiGLU FFNs for the first `first_k_dense_replace` layers and DeepSeek-V3's MoE
(qkv.blocks.moe) after them, a final RMSNorm and an untied output head. Two conversions are needed:

- RoPE layout. With `rope_interleave` (the default) DeepSeek rotates adjacent pairs (x0, x1), (x2, x3), …;
  qkv rotates halves (x_i with x_{i+d/2}). Permuting the rope rows of the query and kv_a projections to
  [even dims; odd dims] once at load time turns one into the other exactly (HF's interleaved function
  itself computes the half-rotation of the de-interleaved vector), so the forward needs no special case.
- Names. MLA's projections take qkv's paper-derived names (q_a_proj → q_down, kv_a_proj_with_mqa → kv_down,
  kv_b_proj → kv_up, …); checkpoints store one gate/up/down triple per expert, as qkv's MoE block does.

Refused with a clear QkvError: pickle-only checkpoints, FP8 (quantized) weights, RoPE scaling (YaRN) and
attention biases, which this loader does not implement. Multi-token-prediction layers (layer index
≥ num_hidden_layers) are skipped, as transformers does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.attention import LatentAttentionConfig
from qkv.blocks import BlockConfig, FeedForwardConfig, MoEConfig, StackConfig
from qkv.errors import QkvError
from qkv.interop.hf_io import Family, NameMap, Ref, hf_value, linear, load_mapped, norm, read_checkpoint, unsupported
from qkv.interop.llama import shell_name_map
from qkv.models import DecoderLM, DecoderLMConfig, EmbeddingConfig
from qkv.norms import NormConfig
from qkv.positional import RotaryPositionsConfig

NAME = "DeepSeek-V3"
MODEL_TYPE = "deepseek_v3"


def config_from_hf(hf: dict[str, Any], tensor_names: Collection[str] = ()) -> DecoderLMConfig:
    """DecoderLMConfig (MLA, MoE) for a DeepSeek-V3 config.json; refuses what qkv does not implement."""
    if hf.get("model_type") != MODEL_TYPE:
        raise QkvError(f"not a {NAME} config: model_type is {hf.get('model_type')!r}, expected {MODEL_TYPE!r}")
    if hf.get("quantization_config"):
        raise unsupported(NAME, "quantization_config", hf["quantization_config"].get("quant_method", "?"))
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":  # YaRN would also change the softmax scale (mscale); not implemented
        raise unsupported(NAME, "rope_type", rope_type)
    for option, supported in (("attention_bias", False), ("hidden_act", "silu")):
        if hf.get(option, supported) != supported:
            raise unsupported(NAME, option, hf[option])
    n_heads = hf_value(hf, "num_attention_heads", NAME)
    if hf.get("num_key_value_heads") not in (None, n_heads):  # MLA's heads all read one latent
        raise unsupported(NAME, "num_key_value_heads", hf["num_key_value_heads"])
    dense = FeedForwardConfig(d_ff=hf_value(hf, "intermediate_size", NAME), activation="swiglu", bias=False,
                              dropout=0.0)  # fmt: skip
    block = BlockConfig(attention=_latent(hf, n_heads), ffn=dense, norm=NormConfig(kind="rms", eps=hf_value(
                        hf, "rms_norm_eps", NAME, 1e-6), bias=False), norm_placement="pre", dropout=0.0)  # fmt: skip
    n_layers, layers = hf_value(hf, "num_hidden_layers", NAME), ()
    base = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if hf.get("n_routed_experts"):  # the first first_k_dense_replace layers keep a dense feed-forward
        layers = (block,) * min(n_layers, hf.get("first_k_dense_replace") or 0)
        block = dataclasses.replace(block, ffn=_moe(hf))
    return DecoderLMConfig(
        vocab_size=hf_value(hf, "vocab_size", NAME),
        d_model=hf_value(hf, "hidden_size", NAME),
        max_positions=hf_value(hf, "max_position_embeddings", NAME),
        embedding=EmbeddingConfig(positions=RotaryPositionsConfig(base=base), dropout=0.0),
        decoder=StackConfig(n_layers=n_layers, block=block, layers=layers, final_norm=True),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _latent(hf: dict[str, Any], n_heads: int) -> LatentAttentionConfig:
    """MLA as config.json sizes it."""
    return LatentAttentionConfig(n_heads=n_heads, bias=False, dropout=0.0, kv_lora_rank=hf_value(hf, "kv_lora_rank",
                                 NAME), q_lora_rank=hf.get("q_lora_rank"), qk_nope_head_dim=hf_value(
                                 hf, "qk_nope_head_dim", NAME), qk_rope_head_dim=hf_value(hf, "qk_rope_head_dim", NAME),
                                 v_head_dim=hf_value(hf, "v_head_dim", NAME))  # fmt: skip


def _moe(hf: dict[str, Any]) -> MoEConfig:
    """DeepSeek-V3's mixture of experts as config.json sizes it."""
    return MoEConfig(d_ff=hf_value(hf, "moe_intermediate_size", NAME), activation="swiglu", bias=False, dropout=0.0,
                     experts=hf["n_routed_experts"], top_k=hf_value(hf, "num_experts_per_tok", NAME),
                     shared_experts=hf.get("n_shared_experts", 1) or 0, groups=hf.get("n_group") or 1,
                     topk_groups=hf.get("topk_group") or 1, norm_topk=bool(hf.get("norm_topk_prob", True)),
                     scale=float(hf.get("routed_scaling_factor", 1.0)))  # fmt: skip


@dataclass(frozen=True)
class DeinterleavedRef(Ref):
    """A projection whose last `rope_dim` rows in every `group` rows are DeepSeek's interleaved RoPE pairs.

    Reordering those rows to [even dims; odd dims] turns pairwise RoPE into qkv's rotate-half RoPE exactly.
    """

    rope_dim: int = 0
    group: int = 1

    def to_qkv(self, t: Tensor) -> Tensor:
        """The checkpoint tensor with each group's rope rows de-interleaved."""
        t = super().to_qkv(t)
        order = torch.cat([torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)])
        rows = t.reshape(-1, self.group, *t.shape[1:]).clone()  # (groups, group, ...)
        rows[:, self.group - self.rope_dim :] = rows[:, order + self.group - self.rope_dim]
        return rows.reshape(t.shape)


def _swiglu(qkv: str, hf: str) -> NameMap:
    """Refs for a SwiGLU FeedForward (gate, up, down) stored as gate_proj, up_proj, down_proj."""
    return {k: v for proj, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
            for k, v in linear(f"{qkv}.{proj}", f"{hf}.{name}", bias=False).items()}  # fmt: skip


def name_map(cfg: DecoderLMConfig, rope_interleave: bool = True) -> NameMap:
    """Where each DecoderLM tensor lives in a DeepseekV3ForCausalLM checkpoint."""
    refs = shell_name_map(cfg)
    for i, block in enumerate(cfg.decoder.blocks()):
        q, h = f"decoder.layers.{i}", f"model.layers.{i}"
        refs |= norm(f"{q}.self_residual.norm", f"{h}.input_layernorm", bias=False)
        refs |= norm(f"{q}.ffn_residual.norm", f"{h}.post_attention_layernorm", bias=False)
        assert isinstance(block.attention, LatentAttentionConfig)
        refs |= _latent_refs(block.attention, cfg.d_model, f"{q}.self_attn", f"{h}.self_attn", rope_interleave)
        if isinstance(block.ffn, MoEConfig):
            refs[f"{q}.ffn.router.weight"] = Ref(f"{h}.mlp.gate.weight")
            refs[f"{q}.ffn.score_bias"] = Ref(f"{h}.mlp.gate.e_score_correction_bias")
            for e in range(block.ffn.experts):
                refs |= _swiglu(f"{q}.ffn.experts.{e}", f"{h}.mlp.experts.{e}")
            if block.ffn.shared_experts:
                refs |= _swiglu(f"{q}.ffn.shared", f"{h}.mlp.shared_experts")
        else:
            refs |= _swiglu(f"{q}.ffn", f"{h}.mlp")
    return refs


def _latent_refs(mla: LatentAttentionConfig, d_model: int, a: str, ha: str, rope_interleave: bool) -> NameMap:
    """MLA's projections, named as DeepSeek names them, with its RoPE rows de-interleaved where it interleaves."""
    kv_lora_rank, nope, d_r, _ = mla.sizes(d_model)

    def rope_rows(hf: str, group: int) -> Ref:
        """A projection with RoPE rows at the end of every `group` rows."""
        return DeinterleavedRef(hf, rope_dim=d_r, group=group) if rope_interleave else Ref(hf)

    refs: NameMap = {}
    if mla.q_lora_rank is None:
        refs[f"{a}.q_proj.weight"] = rope_rows(f"{ha}.q_proj.weight", nope + d_r)
    else:
        refs |= linear(f"{a}.q_down", f"{ha}.q_a_proj", bias=False)
        refs |= norm(f"{a}.q_norm", f"{ha}.q_a_layernorm", bias=False)
        refs[f"{a}.q_up.weight"] = rope_rows(f"{ha}.q_b_proj.weight", nope + d_r)
    refs[f"{a}.kv_down.weight"] = rope_rows(f"{ha}.kv_a_proj_with_mqa.weight", kv_lora_rank + d_r)
    refs |= norm(f"{a}.kv_norm", f"{ha}.kv_a_layernorm", bias=False)
    refs |= linear(f"{a}.kv_up", f"{ha}.kv_b_proj", bias=False)
    refs |= linear(f"{a}.out_proj", f"{ha}.o_proj", bias=False)
    return refs


def _registry_config(hf: dict[str, Any], tensor_names: Collection[str]) -> DecoderLMConfig:
    """config_from_hf for the family registry, whose name_map(cfg) cannot see rope_interleave: refuse False there."""
    if hf.get("rope_interleave", True) is False:
        raise QkvError(f"{NAME} with rope_interleave=false: load it with qkv.interop.deepseek.from_hf_deepseek_v3")
    return config_from_hf(hf, tensor_names)


FAMILY = Family(
    name=NAME,
    model_types=(MODEL_TYPE,),
    config_from_hf=_registry_config,
    name_map=name_map,  # rope_interleave=True, as in every DeepSeek-V3 release
    ignored=(r"^lm_head\.weight$",),  # a tied copy
)


def from_hf_deepseek_v3(path: str | Path) -> DecoderLM:
    """Load a Hugging Face DeepSeek-V3 directory (config.json + safetensors, never pickle) as an eval-mode DecoderLM."""
    ckpt = read_checkpoint(path)
    cfg = config_from_hf(ckpt.config, ckpt.tensors)
    # Multi-token-prediction modules are stored as layers ≥ num_hidden_layers; the language model skips them.
    ckpt.tensors = {n: t for n, t in ckpt.tensors.items() if not _beyond_last_layer(n, cfg.decoder.n_layers)}
    model = DecoderLM(cfg)
    load_mapped(model, ckpt, FAMILY, name_map(cfg, rope_interleave=bool(ckpt.config.get("rope_interleave", True))))
    return model.eval()


def _beyond_last_layer(name: str, n_layers: int) -> bool:
    """Whether a tensor belongs to a layer index ≥ n_layers (DeepSeek's MTP modules)."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= n_layers


__all__ = ["FAMILY", "DeinterleavedRef", "config_from_hf", "from_hf_deepseek_v3", "name_map"]
