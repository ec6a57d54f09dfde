"""Fine-tuning real checkpoints: the base model a run starts from (GGUF, Hugging Face, qkv), LoRA runs and PEFT.

    base = load_base("SmolLM2-135M-Instruct.Q4_1.gguf")      # model, tokenizer and a hash-pinned reference
    add_lora(base.model, LoRASpec(rank=8))                    # qkv.blocks.lora: only the adapters train
    save_peft(base.model, "adapter/", spec, base.reference)   # adapter_config.json + adapter_model.safetensors

`qkv train --init-from CHECKPOINT [--lora-rank R]` does this through the one training loop (qkv.tasks.lm).
"""

from qkv.finetune.base import Base, base_reference, check_reference, load_base
from qkv.finetune.peft import load_peft, peft_model, save_peft
from qkv.finetune.runs import load_lora_run, lora_spec_of

__all__ = [
    "Base",
    "base_reference",
    "check_reference",
    "load_base",
    "load_lora_run",
    "load_peft",
    "lora_spec_of",
    "peft_model",
    "save_peft",
]
