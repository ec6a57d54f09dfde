"""LoRA (qkv.blocks.lora) against Hugging Face PEFT, and PEFT's adapter format both ways (qkv.finetune.peft).

PEFT is the independent implementation: it wraps qkv's own model by target module names, so both sides share the
base weights, rank, targets and adapter weights, and only the LoRA code differs. B is set non-zero (both libraries
start it at 0, which would make forward parity trivial) and dropout is 0.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import model_cfg
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from qkv.errors import QkvError
from qkv.finetune import load_peft, save_peft
from qkv.interop import save_hf
from qkv.lora import DEFAULT_TARGETS, LoRAConfig, LoRALinear, add_lora, count_parameters, lora_modules, merge_lora
from qkv.models import DecoderLM, DecoderLMConfig

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_llama(seed: int = 0, tie: bool = False) -> DecoderLM:
    """A small Llama-shaped DecoderLM (rotary, RMSNorm, SwiGLU, grouped-query attention, no biases)."""
    torch.manual_seed(seed)
    cfg = model_cfg(DecoderLMConfig, vocab_size=97, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, positions="rotary",
                    norm="rms", activation="swiglu", bias=False, final_norm=True, tie_embeddings=tie,
                    max_positions=64)  # fmt: skip
    return DecoderLM(cfg).eval()


def randomize_b(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero B in every adapter (initial B = 0 would make the adapted model equal the base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.05)


def peft_twin(model: DecoderLM, spec: LoRAConfig) -> Any:
    """PEFT's LoRA around a copy of the qkv base, with the qkv model's adapter weights copied in."""
    base = copy.deepcopy(model)
    for name, m in lora_modules(base).items():  # back to plain Linears: PEFT adapts the base itself
        plain = torch.nn.Linear(m.in_features, m.out_features, bias=False)
        plain.weight = m.weight
        parent, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent), child, plain)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=list(spec.targets))
    twin = get_peft_model(base, config)
    with torch.no_grad():
        for name, m in lora_modules(model).items():
            layer = twin.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(m.lora_A)
            layer.lora_B["default"].weight.copy_(m.lora_B)
    return twin


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, names: list[str]) -> tuple[torch.Tensor, list[Any]]:
    """Next-token loss and the gradients of the named parameters."""
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, [params[n] for n in names])
    return logits.detach(), list(grads)


def test_lora_matches_peft_forward_and_gradients() -> None:
    model, spec = random_llama(), LoRAConfig(rank=4, alpha=8.0)
    add_lora(model, spec)
    randomize_b(model)
    twin = peft_twin(model, spec)
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(2))
    ours_names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    theirs_names = [n.replace(".lora_A", ".lora_A.default.weight").replace(".lora_B", ".lora_B.default.weight")
                    for n in ours_names]  # fmt: skip
    theirs_names = [f"base_model.model.{n}" for n in theirs_names]
    logits, grads = loss_and_grads(model, ids, ours_names)
    peft_logits, peft_grads = loss_and_grads(twin, ids, theirs_names)
    assert len(ours_names) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert (logits - peft_logits).abs().max() <= 1e-6
    for ours, theirs in zip(grads, peft_grads, strict=True):
        assert ours.abs().max() > 0
        assert (ours - theirs).abs().max() <= 1e-6 * max(1.0, theirs.abs().max().item())
    assert count_parameters(model)[0] == sum(p.numel() for p in twin.parameters() if p.requires_grad)


def test_lora_starts_as_the_base_and_merges_into_plain_linears() -> None:
    model = random_llama()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        base_logits = model(ids)
        add_lora(model, LoRAConfig(rank=8, alpha=16.0))
        assert torch.equal(model(ids), base_logits)  # B = 0: the adapted model is the base
        randomize_b(model)
        unmerged = model(ids)
        merge_lora(model)
        merged = model(ids)
    assert (unmerged - base_logits).abs().max() > 1e-3
    assert (merged - unmerged).abs().max() <= 1e-5
    assert not lora_modules(model) and not any(isinstance(m, LoRALinear) for m in model.modules())
    assert set(model.state_dict()) == set(random_llama().state_dict())  # the base's names, nothing added


@settings(max_examples=20, deadline=None)
@given(rank=st.integers(1, 16), alpha=st.floats(0.5, 64.0))
def test_the_update_is_alpha_over_r_times_b_a(rank: int, alpha: float) -> None:
    """LoRALinear(x) = x Wᵀ + (α/r) x Aᵀ Bᵀ, for any rank and α."""
    torch.manual_seed(rank)
    base = torch.nn.Linear(12, 10)
    layer = LoRALinear(base, LoRAConfig(rank=rank, alpha=alpha))
    with torch.no_grad():
        layer.lora_B.normal_()
        x = torch.randn(5, 12)
        expected = x @ base.weight.T + base.bias + (alpha / rank) * (x @ layer.lora_A.T) @ layer.lora_B.T
        assert torch.allclose(layer(x), expected, atol=1e-5, rtol=1e-5)
        assert torch.allclose(layer.delta(), (alpha / rank) * layer.lora_B @ layer.lora_A, atol=1e-5, rtol=1e-5)


def test_only_the_adapters_train() -> None:
    model = random_llama(tie=True)
    total_before = count_parameters(model)[1]
    names = add_lora(model, LoRAConfig(rank=2, targets=("q_proj", "v_proj")))
    trainable, total = count_parameters(model)
    assert names == [f"decoder.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert trainable == 2 * (2 * (64 + 64) + 2 * (64 + 32))  # r·(in + out) for q (64→64) and v (64→32)
    assert total == total_before + trainable
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(rank=0), "--lora-rank must be a positive integer, got 0; try 8"),
        (dict(rank=-3), "--lora-rank must be a positive integer, got -3; try 8"),
        (dict(rank=4, dropout=1.0), "--lora-dropout must be in [0, 1), got 1.0"),
        (dict(rank=4, targets=()), "--lora-targets is empty; name modules, e.g. q_proj,v_proj"),
    ],
)
def test_bad_lora_settings_are_refused_by_name(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(QkvError) as e:
        LoRAConfig(**spec)
    assert str(e.value) == message


def test_targets_that_match_nothing_are_refused_naming_the_layers() -> None:
    with pytest.raises(QkvError) as e:
        add_lora(random_llama(), LoRAConfig(rank=2, targets=("q_proj", "c_attn")))
    assert str(e.value) == ("--lora-targets c_attn match(es) no Linear layer of the model; its layers have down, "
                            "gate, k_proj, out_proj, q_proj, up, v_proj (a plain name matches the last part, a "
                            "regex the whole name)")  # fmt: skip


def test_a_regex_target_selects_by_the_whole_name() -> None:
    names = add_lora(random_llama(), LoRAConfig(rank=2, targets=(r"decoder\.layers\.1\..*_proj",)))
    assert names == [f"decoder.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")]


@pytest.fixture
def exported(tmp_path: Path) -> tuple[DecoderLM, LoRAConfig, Path]:
    """A random Llama with non-zero adapters, its base exported as a Hugging Face directory."""
    model, spec = random_llama(), LoRAConfig(rank=4, alpha=8.0)
    save_hf(model, tmp_path / "base")
    add_lora(model, spec)
    randomize_b(model)
    return model, spec, tmp_path / "base"


def test_an_adapter_saved_by_qkv_loads_in_peft_with_the_same_logits(
    exported: tuple[DecoderLM, LoRAConfig, Path], tmp_path: Path
) -> None:
    model, spec, base = exported
    save_peft(model, tmp_path / "adapter", spec, str(base))
    hf = LlamaForCausalLM.from_pretrained(base, attn_implementation="sdpa").eval()
    peft = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, 97, (2, 15))
    with torch.no_grad():
        assert (model(ids) - peft(ids).logits).abs().max() <= 1e-4
    assert sorted(peft.peft_config["default"].target_modules) == sorted(HF_TARGETS)


def test_an_adapter_saved_by_peft_loads_in_qkv_with_the_same_logits(
    exported: tuple[DecoderLM, LoRAConfig, Path], tmp_path: Path
) -> None:
    _, _, base = exported
    hf = LlamaForCausalLM.from_pretrained(base, attn_implementation="sdpa").eval()
    peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    randomize_peft_b(peft)
    peft.save_pretrained(tmp_path / "peft-adapter")
    qkv_model = random_llama()  # the same base weights (seed 0), without adapters
    spec = load_peft(qkv_model, tmp_path / "peft-adapter")
    assert (spec.rank, spec.alpha) == (4, 8.0)
    assert len(lora_modules(qkv_model)) == 3 * 2
    ids = torch.randint(0, 97, (2, 15))
    with torch.no_grad():
        assert (qkv_model(ids) - peft.eval()(ids).logits).abs().max() <= 1e-4


def randomize_peft_b(peft: Any) -> None:
    """Non-zero B in every PEFT adapter."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_a_peft_adapter_for_another_architecture_is_refused(
    exported: tuple[DecoderLM, LoRAConfig, Path], tmp_path: Path
) -> None:
    model, spec, base = exported
    save_peft(model, tmp_path / "adapter", spec, str(base))
    wider = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=97, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                                positions="rotary", norm="rms", activation="swiglu", bias=False,
                                final_norm=True, tie_embeddings=False))  # fmt: skip
    with pytest.raises(QkvError, match="an adapter for another architecture or size"):
        load_peft(wider, tmp_path / "adapter")
    gpt = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=97, n_layers=2, d_model=64,
                              n_heads=4))  # GPT-2-shaped: c_attn …
    with pytest.raises(QkvError, match="adapts no module of this DecoderLM — an adapter for another architecture"):
        load_peft(gpt, tmp_path / "adapter")


def test_default_targets_are_every_attention_and_feed_forward_projection() -> None:
    model = random_llama()
    names = add_lora(model, LoRAConfig())
    assert {n.rsplit(".", 1)[-1] for n in names} == set(DEFAULT_TARGETS)
    assert len(names) == 2 * len(DEFAULT_TARGETS)


def test_adapters_off_gives_the_base_exactly_and_restores_them() -> None:
    from qkv.lora import adapters_off

    base = random_llama()
    adapted = copy.deepcopy(base)
    add_lora(adapted, LoRAConfig(rank=4))
    randomize_b(adapted)
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        tuned = adapted(ids)
        with adapters_off(adapted):
            assert torch.equal(adapted(ids), base(ids))
        assert torch.equal(adapted(ids), tuned) and (tuned - base(ids)).abs().max() > 1e-4
