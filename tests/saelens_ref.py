"""SAELens's side of the SAE parity tests, run in .venv-saelens (SAELens pins transformer-lens < 4; qkv's tests pin 4).

    python tests/saelens_ref.py train IN.safetensors CFG_JSON OUT.safetensors
        the training SAE of CFG_JSON (SAELens's TopK, BatchTopK or Standard training config) with IN's weights:
        encode, decode and forward of IN's x, and training_forward_pass's losses and gradients with IN's dead mask
    python tests/saelens_ref.py load DIR IN.safetensors OUT.safetensors
        SAE.load_from_disk(DIR): encode and forward of IN's x
    python tests/saelens_ref.py save DIR ARCH IN.safetensors OUT.safetensors
        a fresh SAELens training SAE of ARCH (seeded), saved with save_inference_model into DIR, and its encode and
        forward of IN's x as the inference SAE computes them
"""

from __future__ import annotations

import json
import sys

import torch
from sae_lens import (
    SAE,
    BatchTopKTrainingSAE,
    BatchTopKTrainingSAEConfig,
    StandardTrainingSAE,
    StandardTrainingSAEConfig,
    TopKTrainingSAE,
    TopKTrainingSAEConfig,
)
from sae_lens.saes.sae import SAEMetadata, TrainStepInput
from safetensors.torch import load_file, save_file

CLASSES = {
    "topk": (TopKTrainingSAE, TopKTrainingSAEConfig),
    "batchtopk": (BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig),
    "standard": (StandardTrainingSAE, StandardTrainingSAEConfig),
}


def training_sae(cfg: dict) -> torch.nn.Module:
    """A SAELens training SAE of cfg's architecture and settings."""
    cfg = dict(cfg)
    sae_class, cfg_class = CLASSES[cfg.pop("architecture")]
    return sae_class(cfg_class(**cfg))


def train(inputs: str, cfg_json: str, out: str) -> None:
    """Forward, losses and gradients of the training SAE with the given weights."""
    data = load_file(inputs)
    cfg = json.loads(cfg_json)
    sae = training_sae(cfg)
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            getattr(sae, name).copy_(data[name])
        if "topk_threshold" in data:
            sae.topk_threshold = data["topk_threshold"].double()
    x = data["x"]
    results = {"encode": sae.encode(x).detach(), "forward": sae(x).detach()}
    results["decode"] = sae.decode(results["encode"]).detach()
    coefficients = {"l1": cfg["l1_coefficient"]} if "l1_coefficient" in cfg else {}
    step = TrainStepInput(sae_in=x, coefficients=coefficients, dead_neuron_mask=data["dead"].bool(),
                          n_training_steps=0, is_logging_step=False)  # fmt: skip
    sae.train()
    output = sae.training_forward_pass(step)
    output.loss.backward()
    results["loss"] = output.loss.detach()
    for name, value in output.losses.items():
        results[f"loss_{name}"] = torch.as_tensor(value).detach()
    for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
        results[f"grad_{name}"] = getattr(sae, name).grad
    if hasattr(sae, "topk_threshold"):
        results["topk_threshold"] = sae.topk_threshold.detach().clone()
    save_file({k: v.contiguous() for k, v in results.items()}, out)


def load(directory: str, inputs: str, out: str) -> None:
    """An SAE saved by qkv, loaded by SAELens: its encode and forward."""
    sae = SAE.load_from_disk(directory)
    x = load_file(inputs)["x"]
    with torch.no_grad():
        save_file({"encode": sae.encode(x).contiguous(), "forward": sae(x).contiguous()}, out)


def save(directory: str, arch: str, inputs: str, out: str) -> None:
    """A fresh SAELens SAE saved for qkv to load, and what SAELens's loaded inference SAE computes."""
    torch.manual_seed(0)
    cfg = {"architecture": arch, "d_in": 16, "d_sae": 64,
           "metadata": SAEMetadata(model_name="test", hook_name="decoder.layers.1.resid_pre")}  # fmt: skip
    cfg |= {"k": 4} if arch != "standard" else {"l1_coefficient": 2.0}
    sae = training_sae(cfg)
    with torch.no_grad():  # weights away from the symmetric initialisation, decoder norms not 1
        sae.W_enc.normal_(0, 0.3)
        sae.W_dec.mul_(torch.rand(64, 1) + 0.5)
        sae.b_enc.normal_(0, 0.1)
        sae.b_dec.normal_(0, 0.1)
        if arch == "batchtopk":
            sae.topk_threshold = torch.tensor(0.05, dtype=torch.double)
    sae.save_inference_model(directory)
    loaded = SAE.load_from_disk(directory)
    x = load_file(inputs)["x"]
    with torch.no_grad():
        save_file({"encode": loaded.encode(x).contiguous(), "forward": loaded(x).contiguous()}, out)


if __name__ == "__main__":
    {"train": train, "load": load, "save": save}[sys.argv[1]](*sys.argv[2:])
