"""Tests for the DeepSeek-V3 loader (qkv.interop.deepseek) and the MoE block (qkv.blocks.moe) against transformers.

A small DeepseekV3Config (hidden 64, 4 heads, kv_lora_rank 16, qk_nope 8, qk_rope 4, v_head 8, 3 layers: one
dense, two MoE with 8 routed experts in 2 groups, 1 shared) with random weights is saved by transformers and
loaded by qkv; logits must match to 1e-4 and greedy generation token for token. The norms' weights and the
router's correction bias are randomised too, so that every tensor the loader maps changes the output.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from qkv.attention import LatentKVCache, set_absorb
from qkv.blocks.moe import MoEFeedForward
from qkv.errors import QkvError
from qkv.generation import Sampling, generate
from qkv.interop import from_hf
from qkv.interop.deepseek import from_hf_deepseek_v3

SMALL: dict[str, Any] = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
                         "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                         "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                         "qk_rope_head_dim": 4, "v_head_dim": 8, "max_position_embeddings": 64,
                         "initializer_range": 0.2, "eos_token_id": None, "bos_token_id": None}  # fmt: skip


def _hf_model(**overrides: Any) -> Any:
    """A DeepseekV3ForCausalLM (eager attention) with random weights, norms and correction biases."""
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**SMALL, **overrides})).eval()
    model.set_attn_implementation("eager")  # the plain softmax(QKᵀ)V reference
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                tensor.normal_(0.0, 0.1)
    return model


def _save(model: Any, directory: Path) -> Path:
    """save_pretrained, quietly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("q_lora_rank", "rope_interleave"), [(24, True), (None, False)])
@torch.no_grad()
def test_logits_and_greedy_generation_match_transformers(
    tmp_path: Path, q_lora_rank: int | None, rope_interleave: bool
) -> None:
    hf = _hf_model(q_lora_rank=q_lora_rank, rope_interleave=rope_interleave)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every checkpoint tensor must be used: no "ignoring tensor(s)" warning
        model = from_hf_deepseek_v3(_save(hf, tmp_path))
    layers = model.decoder.layers
    assert isinstance(layers[1].ffn, MoEFeedForward) and not isinstance(layers[0].ffn, MoEFeedForward)
    ids = torch.randint(0, 97, (2, 16))
    reference = hf(ids).logits
    assert (model(ids) - reference).abs().max().item() <= 1e-4  # naive decompression
    set_absorb(model, True)
    assert (model(ids) - reference).abs().max().item() <= 1e-4  # absorbed weights
    set_absorb(model, False)
    prompt = ids[:1, :5]
    expected = hf.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(generate(model, prompt, 20, Sampling(temperature=0.0)), expected)
    assert isinstance(model.new_cache()[0].self_attn, LatentKVCache)


@torch.no_grad()
def test_family_registry_loads_deepseek_v3(tmp_path: Path) -> None:
    hf = _hf_model(num_hidden_layers=2, q_lora_rank=24)
    model = from_hf(_save(hf, tmp_path / "interleaved"))  # qkv.from_hf dispatches on model_type "deepseek_v3"
    ids = torch.randint(0, 97, (1, 9))
    assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    hf.config.rope_interleave = False  # the registry's name map cannot see this flag: it refuses, never guesses
    with pytest.raises(QkvError, match=r"load it with qkv\.interop\.deepseek\.from_hf_deepseek_v3"):
        from_hf(_save(hf, tmp_path / "halves"))


@torch.no_grad()
def test_moe_block_matches_transformers() -> None:
    hf = _hf_model(num_hidden_layers=2).model.layers[1].mlp
    ours = MoEFeedForward(64, 32, n_experts=8, top_k=2, n_shared=1, n_groups=2, topk_groups=1, scale=2.5)
    state = {"router.weight": hf.gate.weight, "score_bias": hf.gate.e_score_correction_bias}
    for name in ("gate", "up", "down"):
        state[f"shared.{name}.weight"] = getattr(hf.shared_experts, f"{name}_proj").weight
    for e in range(8):  # transformers holds the experts fused: gate_up_proj (E, 2·I, d), down_proj (E, d, I)
        gate, up = hf.experts.gate_up_proj[e].chunk(2, dim=0)
        state |= {f"experts.{e}.gate.weight": gate, f"experts.{e}.up.weight": up}
        state[f"experts.{e}.down.weight"] = hf.experts.down_proj[e]
    ours.load_state_dict(state)  # strict: every tensor of the block is set
    x = torch.randn(3, 7, 64)
    assert (ours(x) - hf(x)).abs().max().item() <= 1e-5
    gates, experts = ours.route(x.flatten(0, 1))
    assert ((experts // 4) == (experts[:, :1] // 4)).all()  # topk_group=1: both experts from one group
    assert torch.allclose(gates.sum(dim=-1), torch.full((21,), 2.5))  # renormalised, then scaled


def test_loader_skips_multi_token_prediction_layers(tmp_path: Path) -> None:
    directory = _save(_hf_model(num_hidden_layers=2, q_lora_rank=24), tmp_path)
    tensors = safetensors.torch.load_file(directory / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP module, as DeepSeek-V3 ships
    safetensors.torch.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_hf_deepseek_v3(directory).cfg.decoder.n_layers == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 40, "rope_theta": 10000.0}}, r"rope_type='yarn'"),
        ({"model_type": "llama"}, r"not a DeepSeek-V3 config"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config='fp8'"),
        ({"attention_bias": True}, r"attention_bias=True"),
    ],
)
def test_loader_refuses_what_it_does_not_implement(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    directory = _save(_hf_model(num_hidden_layers=1), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(QkvError, match=message):
        from_hf_deepseek_v3(directory)


def test_loader_refuses_pickle(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(QkvError, match="refusing to load pickle"):
        from_hf_deepseek_v3(tmp_path)
