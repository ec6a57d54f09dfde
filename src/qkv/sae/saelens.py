"""SAELens's format, both ways: a directory with cfg.json and sae_weights.safetensors (SAELens 6).

Saving writes what SAELens's own `save_inference_model` writes (with one correction: a BatchTopK threshold is
divided by the input scale, which SAELens's trainer leaves as it is): the input scale folded into the weights
(normalize_activations "none"), and for TopK and BatchTopK the decoder's row norms folded into the encoder, so that
W_dec's rows are unit vectors. A BatchTopK SAE is saved as SAELens saves one, as a JumpReLU SAE whose thresholds are
the learned one. Loading reads SAELens's topk, standard and jumprelu SAEs (any dtype, as float32).

The metadata keep where the SAE belongs: hook_name (qkv's name of the activation), model_name, and under "qkv" the
model's reference (path, sha256, kind) and how the training data was filtered, so that it is not applied elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.io.files import atomic_save_safetensors, atomic_write_json, load_json, load_safetensors
from qkv.sae.model import SAEConfig, SparseAutoencoder

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
FORMAT_VERSION = "6.54.0"  # the SAELens version whose format this writes (6.x: metadata nested, as loaders expect)


def folded_weights(sae: SparseAutoencoder) -> dict[str, torch.Tensor]:
    """The SAE's weights as SAELens saves them (SparseAutoencoder.folded), under SAELens's names."""
    folded = sae.folded()
    out = {name: getattr(folded, name) for name in ("W_enc", "W_dec", "b_enc", "b_dec")}
    if sae.cfg.architecture == "batchtopk":
        out["threshold"] = folded.threshold
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def saelens_config(sae: SparseAutoencoder, metadata: dict[str, Any]) -> dict[str, Any]:
    """cfg.json's contents for the folded weights."""
    cfg = sae.cfg
    arch = {"topk": "topk", "batchtopk": "jumprelu", "relu": "standard"}[cfg.architecture]
    out: dict[str, Any] = {"architecture": arch, "d_in": cfg.d_model, "d_sae": cfg.latents, "dtype": "float32",
                           "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
                           "reshape_activations": "none"}  # fmt: skip
    if arch == "topk":
        out |= {"k": cfg.k, "rescale_acts_by_decoder_norm": cfg.rescale_by_decoder_norm}
    details = {"k": cfg.k, "aux_loss_coefficient": cfg.aux_coefficient, "decoder_init_norm": cfg.decoder_init_norm}
    if cfg.architecture == "relu":
        details = {"l1_coefficient": cfg.l1_coefficient, "lp_norm": 1.0, "decoder_init_norm": cfg.decoder_init_norm}
    out["metadata"] = {"sae_lens_version": FORMAT_VERSION, "training_architecture": cfg.architecture,
                       "training_architecture_details": details, **metadata}  # fmt: skip
    return out


def save_saelens(sae: SparseAutoencoder, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write `sae` in SAELens's format into `directory` (created); metadata: hook_name, model_name, qkv's own."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(directory / WEIGHTS_FILE, folded_weights(sae))
    atomic_write_json(directory / CFG_FILE, saelens_config(sae, dict(metadata or {})))
    return directory


def load_saelens(directory: str | Path) -> tuple[SparseAutoencoder, dict[str, Any]]:
    """An SAE saved by SAELens (or by save_saelens), in eval mode, and its metadata."""
    directory = Path(directory)
    if not (directory / CFG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise QkvError(f"{directory} is not an SAE in SAELens's format (it needs {CFG_FILE} and {WEIGHTS_FILE})")
    raw = load_json(directory / CFG_FILE, "SAELens config")
    weights = {k: v.float() for k, v in load_safetensors(directory / WEIGHTS_FILE).items()}
    metadata = dict(raw.get("metadata") or {})
    cfg = _config_of(raw, metadata, directory)
    missing = {"W_enc", "W_dec", "b_enc", "b_dec"} - set(weights)
    if cfg.architecture == "batchtopk" and "threshold" not in weights:
        missing.add("threshold")
    if missing:
        raise QkvError(f"{directory / WEIGHTS_FILE} lacks {', '.join(sorted(missing))}")
    sae = cfg.build().eval()
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            _copy(getattr(sae, name), weights[name], name, directory)
        if not raw.get("apply_b_dec_to_input", True):  # x·W_enc = (x − b_dec)·W_enc + b_dec·W_enc
            sae.b_enc.add_(sae.b_dec @ sae.W_enc)
        if "threshold" in weights:
            _copy(sae.threshold, weights["threshold"].double(), "threshold", directory)
    return sae, metadata


def _config_of(raw: dict[str, Any], metadata: dict[str, Any], directory: Path) -> SAEConfig:
    """The qkv config of a SAELens cfg.json; what qkv cannot run exactly is refused in one line."""
    arch = raw.get("architecture", "standard")
    if raw.get("normalize_activations", "none") != "none" or raw.get("reshape_activations", "none") != "none":
        raise QkvError(f"{directory / CFG_FILE}: normalize_activations {raw.get('normalize_activations')!r} and "
                       f"reshape_activations {raw.get('reshape_activations')!r} are not supported; fold them first")
    details = metadata.get("training_architecture_details") or {}
    try:
        common: dict[str, Any] = {"d_model": int(raw["d_in"]), "d_sae": int(raw["d_sae"])}
    except (KeyError, TypeError, ValueError):
        raise QkvError(f"{directory / CFG_FILE} needs d_in and d_sae as whole numbers") from None
    if arch == "topk":
        return SAEConfig(**common, architecture="topk", k=int(raw.get("k", 100)),
                         rescale_by_decoder_norm=bool(raw.get("rescale_acts_by_decoder_norm", False)))  # fmt: skip
    if arch == "standard":
        return SAEConfig(**common, architecture="relu", l1_coefficient=float(details.get("l1_coefficient", 1.0)))
    if arch == "jumprelu":  # BatchTopK's inference form, or any JumpReLU SAE: ReLU(pre) where pre > threshold
        k = details.get("k", 1)
        return SAEConfig(**common, architecture="batchtopk", k=max(1, round(float(k))), rescale_by_decoder_norm=False)
    raise QkvError(f"{directory / CFG_FILE}: SAELens architecture {arch!r} is not one qkv reads (topk, standard, "
                   "jumprelu)")  # fmt: skip


def _copy(target: torch.Tensor, value: torch.Tensor, name: str, directory: Path) -> None:
    """Copy one tensor in, refusing a shape that does not match cfg.json."""
    if value.shape != target.shape:
        raise QkvError(f"{directory / WEIGHTS_FILE}: {name} has shape {tuple(value.shape)}, cfg.json says "
                       f"{tuple(target.shape)}")  # fmt: skip
    target.copy_(value)
