"""The sparse autoencoder against SAELens 6.54 (run in .venv-saelens by tests/saelens_ref.py): forward, encode,
decode, training loss and gradients with the same weights and batch; and SAELens's format, both ways."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from qkv.errors import QkvError
from qkv.sae import SAEConfig, SparseAutoencoder, load_saelens, save_saelens

ROOT = Path(__file__).resolve().parents[1]
SAELENS_PYTHON = ROOT / ".venv-saelens" / "bin" / "python"
CLOSE = {"atol": 1e-5, "rtol": 1e-5}


def saelens(*args: str) -> None:
    """tests/saelens_ref.py in SAELens's venv (made by `bash scripts/setup.sh --dev`)."""
    assert SAELENS_PYTHON.exists(), "no .venv-saelens: run `bash scripts/setup.sh --dev`, which makes it"
    subprocess.run([str(SAELENS_PYTHON), str(ROOT / "tests" / "saelens_ref.py"), *args], check=True,
                   capture_output=True, text=True)  # fmt: skip


def random_sae(architecture: str, seed: int = 0, **settings: Any) -> SparseAutoencoder:
    """An SAE with weights away from initialisation: decoder norms not 1, biases not 0."""
    torch.manual_seed(seed)
    sae = SAEConfig(d_model=16, d_sae=64, architecture=architecture, k=4, **settings).build()  # type: ignore[arg-type]
    with torch.no_grad():
        sae.W_enc.normal_(0, 0.3)
        sae.W_dec.mul_(torch.rand(64, 1) + 0.5)
        sae.b_enc.normal_(0, 0.1)
        sae.b_dec.normal_(0, 0.1)
    return sae


SAELENS_CFG = {
    "topk": {"architecture": "topk", "k": 4, "aux_loss_coefficient": 0.5},
    "batchtopk": {"architecture": "batchtopk", "k": 4, "aux_loss_coefficient": 0.5, "topk_threshold_lr": 0.01},
    "relu": {"architecture": "standard", "l1_coefficient": 2.0},
}
QKV_SETTINGS = {"topk": {"aux_coefficient": 0.5}, "batchtopk": {"aux_coefficient": 0.5},
                "relu": {"l1_coefficient": 2.0}}  # fmt: skip
LOSS_PART = {"topk": "loss_auxiliary_reconstruction_loss", "batchtopk": "loss_auxiliary_reconstruction_loss",
             "relu": "loss_l1_loss"}  # fmt: skip


@pytest.mark.parametrize("architecture", ["topk", "batchtopk", "relu"])
def test_the_forward_pass_loss_and_gradients_equal_saelens(architecture: str, tmp_path: Path) -> None:
    """Same weights, batch and dead latents: encode, decode, forward, MSE, the auxiliary loss (AuxK or the
    norm-weighted L1), the total, every gradient, and BatchTopK's threshold update equal SAELens's to 1e-5."""
    sae = random_sae(architecture, **QKV_SETTINGS[architecture])
    x = torch.randn(32, 16) * 2
    dead = torch.zeros(64, dtype=torch.bool)
    dead[torch.randperm(64)[:20]] = True  # 20 dead latents: AuxK's k_aux = 8 of them, weighted 1
    inputs = {name: getattr(sae, name).detach().clone() for name in ("W_enc", "W_dec", "b_enc", "b_dec")}
    save_file({**inputs, "x": x, "dead": dead.to(torch.uint8)}, tmp_path / "in.safetensors")
    cfg = {**SAELENS_CFG[architecture], "d_in": 16, "d_sae": 64}
    saelens("train", str(tmp_path / "in.safetensors"), json.dumps(cfg), str(tmp_path / "out.safetensors"))
    ref = load_file(tmp_path / "out.safetensors")

    sae.train()  # BatchTopK encodes a batch in training (its threshold is for inference)
    latents = sae.encode(x)
    torch.testing.assert_close(latents, ref["encode"], **CLOSE)
    torch.testing.assert_close(sae.decode(latents), ref["decode"], **CLOSE)
    torch.testing.assert_close(sae(x), ref["forward"], **CLOSE)
    loss = sae.loss(x, dead)
    loss.total.backward()
    torch.testing.assert_close(loss.mse, ref["loss_mse_loss"], **CLOSE)
    torch.testing.assert_close(loss.auxiliary, ref[LOSS_PART[architecture]], **CLOSE)
    torch.testing.assert_close(loss.total, ref["loss"], **CLOSE)
    assert float(loss.auxiliary.detach()) > 0  # the part compared is not a zero on both sides
    for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
        grad = getattr(sae, name).grad
        assert grad is not None
        torch.testing.assert_close(grad, ref[f"grad_{name}"], **CLOSE)
    if architecture == "batchtopk":
        torch.testing.assert_close(sae.threshold, ref["topk_threshold"].double().expand(64), **CLOSE)


@pytest.mark.parametrize("architecture", ["topk", "batchtopk", "relu"])
def test_an_sae_saved_by_qkv_computes_the_same_in_saelens(architecture: str, tmp_path: Path) -> None:
    """save_saelens folds the input scale and the decoder norms in; SAELens's load_from_disk then encodes and
    reconstructs as qkv's folded SAE does, and reconstructs as the SAE before folding did."""
    sae = random_sae(architecture).eval()
    sae.input_scale.fill_(2.5)
    sae.threshold.fill_(0.05)
    x = torch.randn(32, 16) * 2
    save_saelens(sae, tmp_path / "sae", {"hook_name": "decoder.layers.1.resid_pre", "model_name": "test"})
    save_file({"x": x}, tmp_path / "x.safetensors")
    saelens("load", str(tmp_path / "sae"), str(tmp_path / "x.safetensors"), str(tmp_path / "out.safetensors"))
    ref = load_file(tmp_path / "out.safetensors")
    folded = sae.folded()
    torch.testing.assert_close(folded.encode(x), ref["encode"], **CLOSE)
    torch.testing.assert_close(folded(x), ref["forward"], **CLOSE)
    torch.testing.assert_close(sae(x), ref["forward"], **CLOSE)
    assert int((ref["encode"] > 0).sum()) > 0
    loaded, metadata = load_saelens(tmp_path / "sae")  # and back into qkv
    torch.testing.assert_close(loaded.encode(x), folded.encode(x), **CLOSE)
    assert metadata["hook_name"] == "decoder.layers.1.resid_pre"


@pytest.mark.parametrize("architecture", ["topk", "batchtopk", "standard"])
def test_an_sae_saved_by_saelens_computes_the_same_in_qkv(architecture: str, tmp_path: Path) -> None:
    """SAELens's save_inference_model (TopK with its norms folded; BatchTopK as JumpReLU; Standard as it is), loaded
    by qkv: the same latents and reconstruction as SAELens's own loaded SAE."""
    x = torch.randn(32, 16) * 2
    save_file({"x": x}, tmp_path / "x.safetensors")
    saelens("save", str(tmp_path / "sae"), architecture, str(tmp_path / "x.safetensors"),
            str(tmp_path / "out.safetensors"))  # fmt: skip
    ref = load_file(tmp_path / "out.safetensors")
    sae, metadata = load_saelens(tmp_path / "sae")
    torch.testing.assert_close(sae.encode(x), ref["encode"], **CLOSE)
    torch.testing.assert_close(sae(x), ref["forward"], **CLOSE)
    assert int((ref["encode"] > 0).sum()) > 0
    assert metadata["hook_name"] == "decoder.layers.1.resid_pre"


@settings(max_examples=25, deadline=None)
@given(arch=st.sampled_from(["topk", "batchtopk", "relu"]), scale=st.floats(0.05, 20.0),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_folding_keeps_the_function(arch: str, scale: float, seed: int) -> None:
    """The folded SAE (no input scale, unit decoder rows) reconstructs exactly as the SAE it came from."""
    sae = random_sae(arch, seed).eval()
    sae.input_scale.fill_(scale)
    sae.threshold.fill_(0.02)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed)) / scale
    folded = sae.folded()
    torch.testing.assert_close(folded(x), sae(x), atol=1e-5, rtol=1e-4)
    assert torch.equal(folded.encode(x) > 0, sae.encode(x) > 0)
    if arch != "relu":
        torch.testing.assert_close(folded.decoder_norms(), torch.ones(64))


def test_batchtopk_keeps_k_per_token_on_average_and_its_threshold_after() -> None:
    """BatchTopK keeps k·N latents over a batch of N while training (tokens share the budget unevenly); at
    inference its threshold decides each latent alone."""
    x = torch.randn(40, 16) * 3
    sae = random_sae("batchtopk").train()
    latents = sae.encode(x)
    assert int((latents > 0).sum()) == 4 * 40 and len(set((latents > 0).sum(-1).tolist())) > 1
    sae.eval()
    sae.threshold.fill_(0.5)
    pre = sae.pre_activations(x)
    assert torch.equal(sae.encode(x) > 0, pre > 0.5)


def test_dead_latents_are_counted_in_tokens() -> None:
    """A latent is dead once it has not fired for dead_window training tokens; firing resets its count."""
    sae = random_sae("topk", dead_window=50).train()
    x = torch.randn(32, 16)
    fired = sae.encode(x).gt(0).any(0)
    sae.loss(x)
    sae.loss(x)
    assert torch.equal(sae.tokens_since_fired, torch.where(fired, 0, 64))
    assert torch.equal(sae.dead(), ~fired)
    sae.eval()
    sae.loss(x)  # evaluation counts nothing
    assert torch.equal(sae.tokens_since_fired, torch.where(fired, 0, 64))


def test_bad_configs_and_files_are_refused_in_one_line(tmp_path: Path) -> None:
    """k above the latents, an SAE without a width, and a directory that is not SAELens's format."""
    with pytest.raises(QkvError, match=r"k = 9 is more than the 8 latents; lower it \(--model k=…\)"):
        SAEConfig(d_model=4, d_sae=8, k=9)
    with pytest.raises(QkvError, match="width of the activation"):
        SAEConfig().build()
    with pytest.raises(QkvError, match="not an SAE in SAELens's format"):
        load_saelens(tmp_path)
    sae = random_sae("batchtopk")
    save_saelens(sae, tmp_path / "jump")
    weights = load_file(tmp_path / "jump" / "sae_weights.safetensors")
    save_file({k: v for k, v in weights.items() if k != "threshold"}, tmp_path / "jump" / "sae_weights.safetensors")
    with pytest.raises(QkvError, match="lacks threshold"):
        load_saelens(tmp_path / "jump")
    config = json.loads((tmp_path / "jump" / "cfg.json").read_text())
    (tmp_path / "jump" / "cfg.json").write_text(json.dumps({**config, "d_in": "wide"}))
    with pytest.raises(QkvError, match="d_in and d_sae as whole numbers"):
        load_saelens(tmp_path / "jump")
