"""LoRA adapters in Hugging Face PEFT's format, both ways: adapter_config.json + adapter_model.safetensors.

PEFT names an adapter by the module it adapts in the transformers model (base_model.model.model.layers.0.
self_attn.q_proj.lora_A.weight); qkv's modules have qkv's names (decoder.layers.0.self_attn.q_proj). The model's
Hugging Face family (qkv.interop: GPT-2, Llama) maps one to the other, the same map that loads and exports its
weights. A model with no such family keeps qkv's names, which PEFT reads when it wraps qkv's model itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import nn

from qkv.errors import QkvError
from qkv.finetune.base import Base, load_base
from qkv.io.files import atomic_save_safetensors, atomic_write_json, load_json, load_safetensors
from qkv.lora import LoRAConfig, add_lora, lora_modules, merge_lora
from qkv.models import DecoderLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel → LoraModel → the wrapped model
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<part>lora_[AB])(?:\.[^.]+)?\.weight$")


def hf_module_names(model: nn.Module) -> dict[str, str]:
    """qkv module name → the name of the same nn.Linear in the model's transformers class (identity without one)."""
    from qkv.interop import export_family

    modules = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not isinstance(model, DecoderLM):
        return {name: name for name in modules}
    try:
        family = export_family(model)
    except QkvError:
        return {name: name for name in modules}
    refs = family.name_map(model.cfg)
    names = {}
    for name in modules:
        ref = refs.get(f"{name}.weight")
        if ref is not None and ref.parts == 1 and not ref.transposed:
            names[name] = ref.name.removesuffix(".weight")
    return names


def save_peft(model: nn.Module, directory: str | Path, spec: LoRAConfig, base: str = "") -> Path:
    """Write the model's adapters as a PEFT LoRA adapter that peft's PeftModel.from_pretrained loads."""
    adapters = lora_modules(model)
    if not adapters:
        raise QkvError("the model has no LoRA adapters to save; train with --lora-rank")
    names = hf_module_names(model)
    unmapped = sorted(n for n in adapters if n not in names)
    if unmapped:  # GPT-2 fuses q, k and v into one Conv1D: one adapter each has no PEFT equivalent there
        raise QkvError(f"{unmapped[0]} has no single Linear of its own in the Hugging Face model (fused or "
                       "transposed there); adapt other modules to save in PEFT's format")  # fmt: skip
    tensors = {}
    for name, m in adapters.items():
        tensors[f"{PREFIX}{names[name]}.lora_A.weight"] = m.lora_A.detach().contiguous()
        tensors[f"{PREFIX}{names[name]}.lora_B.weight"] = m.lora_B.detach().contiguous()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(directory / ADAPTER_WEIGHTS, tensors, metadata={"format": "pt"})
    targets = sorted({names[n].rsplit(".", 1)[-1] for n in adapters})
    atomic_write_json(directory / ADAPTER_CONFIG, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": spec.rank,
        "lora_alpha": spec.effective_alpha, "lora_dropout": spec.dropout, "target_modules": targets, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True,
    })  # fmt: skip
    return directory


def _read_config(directory: Path) -> dict[str, Any]:
    """adapter_config.json, refused (in one line) where it asks for what qkv's LoRA does not do."""
    if not (directory / ADAPTER_CONFIG).is_file():
        raise QkvError(f"{directory} is not a PEFT adapter ({ADAPTER_CONFIG} missing)")
    config = load_json(directory / ADAPTER_CONFIG)
    if config.get("peft_type") != "LORA":
        raise QkvError(f"{directory}: a {config.get('peft_type')} adapter; qkv reads LoRA adapters")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise QkvError(f"{directory}: {key}=true is not supported by qkv's LoRA; train the adapter without it")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if config.get(key):
            raise QkvError(f"{directory}: {key} is not supported by qkv's LoRA (one rank and alpha for all modules)")
    return config


def load_peft(model: nn.Module, directory: str | Path) -> LoRAConfig:
    """Add a PEFT LoRA adapter's modules to the model and load its weights; refuse one for another architecture."""
    directory = Path(directory)
    config = _read_config(directory)
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise QkvError(f"{directory} has no {ADAPTER_WEIGHTS} (qkv reads safetensors only, never adapter_model.bin)")
    tensors = load_safetensors(directory / ADAPTER_WEIGHTS)
    to_qkv = {hf: qkv for qkv, hf in hf_module_names(model).items()}
    found: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        module = to_qkv.get(match["module"]) if match else None
        if match is None or module is None:
            kind = type(model).__name__
            raise QkvError(f"{directory}: adapter tensor {key} adapts no module of this {kind} — an adapter for "
                           "another architecture; load it onto the base it was trained on")  # fmt: skip
        found.setdefault(module, {})[match["part"]] = tensor
    rank = int(config["r"])
    spec = LoRAConfig(rank=rank, alpha=float(config.get("lora_alpha", 8)),
                      dropout=float(config.get("lora_dropout", 0.0)),
                      targets=tuple(re.escape(m) for m in sorted(found)))  # fmt: skip
    add_lora(model, spec)
    for name, m in lora_modules(model).items():
        for part in ("lora_A", "lora_B"):
            given, param = found[name].get(part), getattr(m, part)
            if given is None or given.shape != param.shape:
                shape = None if given is None else tuple(given.shape)
                raise QkvError(f"{directory}: {name}.{part} is {shape} in the adapter, {tuple(param.shape)} in this "
                               "model — an adapter for another architecture or size")  # fmt: skip
            param.data.copy_(given)
    return spec


def peft_model(directory: str | Path, base: str | Path | None = None) -> Base:
    """A PEFT adapter merged onto its base (adapter_config.json's base_model_name_or_path, or `base`)."""

    directory = Path(directory)
    config = _read_config(directory)
    where = base if base is not None else config.get("base_model_name_or_path") or ""
    if not where or not Path(where).exists():
        raise QkvError(f"{directory}'s base {where!r} is not a local checkpoint; give it with --base PATH")
    loaded = load_base(where)
    load_peft(loaded.model, directory)
    merge_lora(loaded.model)
    return loaded
