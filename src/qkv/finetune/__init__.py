"""Fine-tuning real checkpoints: the base model a run starts from (GGUF, Hugging Face, qkv), LoRA runs and PEFT.

    base = load_base("SmolLM2-135M-Instruct.Q4_1.gguf")      # model, tokenizer and a hash-pinned reference
    LoRAConfig(rank=8).apply(base.model)                      # qkv.lora: only the adapters train
    save_peft(base.model, "adapter/", spec, base.reference)   # adapter_config.json + adapter_model.safetensors

`qkv train --init-from CHECKPOINT [--lora-rank R]` does this through the one training loop (qkv.tasks.finetune).
"""

from qkv.finetune.base import Base, base_config, load_base, load_lm_dir, load_lora_run
from qkv.finetune.peft import load_peft, peft_model, save_peft
from qkv.finetune.reference import base_reference, check_reference, is_lora_run, lora_of

__all__ = [
    "Base",
    "base_config",
    "base_reference",
    "check_reference",
    "is_lora_run",
    "load_base",
    "load_lm_dir",
    "load_lora_run",
    "load_peft",
    "lora_of",
    "peft_model",
    "save_peft",
]
