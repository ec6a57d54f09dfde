"""CUDA tests: qkv's GPU paths against its CPU paths, its reference attention and itself.

Every test marked `cuda` skips where torch sees no CUDA GPU (CI); `bash benchmarks/gpu_check.sh` runs them
(`pytest -m cuda tests/test_cuda.py`) on a GPU. The last test, not marked, runs that script's CPU dry run.
Tolerances: fp32 on the GPU vs the CPU (or vs fp64) to 1e-4 or better, bf16 to 2-3 × bf16's 2⁻⁸ rounding step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import config, model_cfg, subprocess_env

import qkv
from qkv.attention.sdpa import scaled_dot_product_attention
from qkv.data import load_shakespeare
from qkv.generation import Sampling, generate
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.tasks import load, train

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(qkv.__file__).resolve().parents[1])  # the qkv under test, also in subprocesses
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


def on_cuda(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test `cuda` and skip it without a GPU."""
    return pytest.mark.cuda(needs_cuda(test))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 20,000-character text (18,000 train / 2,000 validation characters)."""
    path = tmp_path_factory.mktemp("data") / "excerpt.txt"
    path.write_text(load_shakespeare()[:20_000], encoding="utf-8")
    return path


# --- attention: the fused (SDPA) path against the reference formula ---------------------------------------

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # max |error| / max(|truth|, 1), vs an fp64 CPU truth
CASES = ("causal", "padding", "gqa")


def _attention_inputs(case: str) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """q, k, v and an output gradient in fp64 on the CPU, and the call's options, for one case."""
    gen = torch.Generator().manual_seed(1)
    heads_kv = 2 if case == "gqa" else 4
    q, g = (torch.randn(2, 4, 96, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, heads_kv, 96, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    options: dict[str, Any] = {"causal": case != "padding"}
    if case == "padding":  # (B, 1, 1, T_k): the second row's last 30 keys are padding
        mask = torch.ones(2, 1, 1, 96, dtype=torch.bool)
        mask[1, ..., 66:] = False
        options["mask"] = mask
    if case == "gqa":
        options["kv_groups"] = 2
    return [q, k, v, g], options


def _attend(tensors: list[torch.Tensor], options: dict[str, Any], backend: str, device: str,
            dtype: torch.dtype) -> list[torch.Tensor]:  # fmt: skip
    """[output, dq, dk, dv] of one attention call, in fp64 on the CPU."""
    q, k, v, g = (t.to(device, dtype).requires_grad_(i < 3) for i, t in enumerate(tensors))
    opts = {name: (o.to(device) if isinstance(o, torch.Tensor) else o) for name, o in options.items()}
    out = scaled_dot_product_attention(q, k, v, backend=backend, **opts)  # type: ignore[arg-type]
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    return [t.detach().double().cpu() for t in (out, dq, dk, dv)]


@on_cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_attention_matches_the_reference_on_cuda(case: str, dtype: torch.dtype) -> None:
    """Reference and fused paths on the GPU both agree with an fp64 CPU truth: outputs and q, k, v gradients."""
    tensors, options = _attention_inputs(case)
    truth = _attend(tensors, options, "reference", "cpu", torch.float64)
    scale = [t.abs().max().item() for t in truth]  # gradients are compared relative to their size
    for backend in ("reference", "fused"):
        got = _attend(tensors, options, backend, "cuda", dtype)
        for name, a, b, s in zip(("out", "dq", "dk", "dv"), got, truth, scale, strict=True):
            error = (a - b).abs().max().item() / max(s, 1.0)
            assert error < TOL[dtype], f"{backend} {name}: {error:.2e}"


@on_cuda
def test_fused_path_runs_on_the_flash_kernel_in_bf16() -> None:
    """Restricted to PyTorch's flash kernel, qkv's fused causal bf16 path runs and matches the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tensors, options = _attention_inputs("causal")
    reference = _attend(tensors, options, "reference", "cuda", torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # no other kernel may serve: a miss raises
        flash = _attend(tensors, options, "fused", "cuda", torch.bfloat16)
    for a, b in zip(flash, reference, strict=True):
        assert (a - b).abs().max().item() < 3e-2 * max(b.abs().max().item(), 1.0)


# --- the model: GPU forward and gradients equal the CPU's -------------------------------------------------

MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"positions": "learned", "norm": "layer", "activation": "gelu", "bias": True},
    "qkv": {"positions": "rotary", "norm": "rms", "activation": "swiglu", "bias": False, "n_kv_heads": 2},
    "mla": {"positions": "rotary", "norm": "rms", "activation": "swiglu", "bias": False, "attention": "mla"},
}


def _lm(kind: str) -> DecoderLM:
    """A 2-layer DecoderLM of one block kind, dropout 0, seeded."""
    torch.manual_seed(3)
    cfg = model_cfg(DecoderLMConfig, vocab_size=97, d_model=64, n_heads=4, n_layers=2, max_positions=64, dropout=0.0,
                    **MODELS[kind])  # fmt: skip
    return DecoderLM(cfg)


def _loss_and_grads(model: DecoderLM, ids: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """Logits, next-token loss and every parameter's gradient, brought to the CPU."""
    model.zero_grad(set_to_none=True)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().cpu(), loss.item(), grads


@on_cuda
@pytest.mark.parametrize("kind", list(MODELS))
def test_decoder_lm_forward_and_gradients_on_cuda_equal_the_cpu(kind: str) -> None:
    """fp32: the same weights give the same logits (1e-4), loss and gradients (1e-4 of the largest) on both."""
    cpu = _lm(kind)
    gpu = _lm(kind).cuda()
    ids = torch.randint(0, 97, (3, 48), generator=torch.Generator().manual_seed(0))
    logits_cpu, loss_cpu, grads_cpu = _loss_and_grads(cpu, ids)
    logits_gpu, loss_gpu, grads_gpu = _loss_and_grads(gpu, ids.cuda())
    assert (logits_gpu - logits_cpu).abs().max().item() < 1e-4
    assert loss_gpu == pytest.approx(loss_cpu, abs=1e-5)
    assert grads_gpu.keys() == grads_cpu.keys()
    for name, g in grads_cpu.items():
        assert (grads_gpu[name] - g).abs().max().item() <= 1e-4 * max(g.abs().max().item(), 1e-3), name


@on_cuda
@pytest.mark.parametrize("kind", list(MODELS))
def test_cached_greedy_generation_on_cuda_equals_uncached_and_the_cpu(kind: str) -> None:
    """Greedy decoding with the KV cache on the GPU gives the uncached tokens, and the CPU's."""
    model = _lm(kind).eval()
    with torch.no_grad():
        model.embed.tokens.weight.mul_(20)  # well-separated logits: no near-ties for float noise to flip
    prompt = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(1))
    greedy = Sampling(temperature=0.0)
    on_cpu = generate(model, prompt, 20, greedy, use_cache=True)
    model.cuda()
    cached = generate(model, prompt.cuda(), 20, greedy, use_cache=True)
    uncached = generate(model, prompt.cuda(), 20, greedy, use_cache=False)
    assert cached.device.type == "cuda" and cached.shape == (3, 25)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached.cpu(), on_cpu)


# --- the training loop on the GPU ------------------------------------------------------------------------


def _tiny_run(corpus: Path, out: Path, **overrides: Any) -> list[dict[str, Any]]:
    """Train the tiny LM of test_training.py (dropout 0) 6 steps; its metrics.jsonl rows."""
    model = {**config("lm").model, "n_layers": 1, "d_model": 32, "n_heads": 2, "dropout": 0.0}
    settings: dict[str, Any] = {"data": str(corpus), "model": model, "block_size": 32, "batch_size": 4,
                                "eval_interval": 3, "eval_tokens": 1000, "sample_tokens": 0, "warmup_steps": 2,
                                "max_steps": 6, "dtype": "float32", "out_dir": str(out), **overrides}  # fmt: skip
    result = train(config("lm", **settings), verbose=False)
    assert result.step == 6
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@on_cuda
def test_training_on_cuda_takes_the_cpu_steps(tmp_path: Path, corpus: Path) -> None:
    """fp32 AdamW: 6 steps of qkv's loop on the GPU log the CPU's losses (1e-3) and lower the loss.

    AdamW, not the recipe's Muon: on a GPU Muon orthogonalises in bf16 (the mixed-precision test runs it).
    """
    gpu = _tiny_run(corpus, tmp_path / "on-gpu", device="cuda", optimizer="adamw")
    cpu = _tiny_run(corpus, tmp_path / "on-cpu", device="cpu", optimizer="adamw")
    assert [r["step"] for r in gpu] == [r["step"] for r in cpu] == [3, 6]
    for a, b in zip(gpu, cpu, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-3)
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-3)
    assert gpu[-1]["val_loss"] < gpu[0]["val_loss"]


@on_cuda
def test_mixed_precision_training_on_cuda_follows_fp32(tmp_path: Path, corpus: Path) -> None:
    """bf16 autocast, and fp16 with its gradient scaler (the recipe's Muon): within 0.05 of fp32's losses, falling."""
    fp32 = _tiny_run(corpus, tmp_path / "fp32", device="cuda")
    for dtype in ("bfloat16", "float16"):
        mixed = _tiny_run(corpus, tmp_path / dtype, device="cuda", dtype=dtype)
        for a, b in zip(mixed, fp32, strict=True):
            assert a["val_loss"] == pytest.approx(b["val_loss"], abs=0.05), dtype
        assert mixed[-1]["val_loss"] < mixed[0]["val_loss"], dtype


@on_cuda
def test_compiled_training_on_cuda_matches_eager(tmp_path: Path, corpus: Path) -> None:
    """--compile (inductor's Triton kernels) takes the eager run's steps on the GPU, to fp32 reassociation."""
    eager = _tiny_run(corpus, tmp_path / "eager", device="cuda")
    compiled = _tiny_run(corpus, tmp_path / "compiled", device="cuda", compile=True)
    for a, b in zip(compiled, eager, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-3)
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-3)


@on_cuda
def test_training_steps_on_cuda_never_wait_for_the_gpu(tmp_path: Path, corpus: Path) -> None:
    """After the first steps, bf16 AdamW steps (evaluation off, as a benchmark runs them) make no host-device
    synchronisation: the loss stays on the GPU and batches are copied from pinned memory. torch's sync debug
    mode turns any synchronising call into an error."""
    from qkv.training import Hooks, StepInfo

    steps: list[int] = []

    def on_step(info: StepInfo) -> None:
        steps.append(info.step)
        if info.step == 2:  # the first steps allocate and build; from here on only steady-state steps
            torch.cuda.set_sync_debug_mode("error")

    model = {**config("lm").model, "n_layers": 1, "d_model": 32, "n_heads": 2, "dropout": 0.0}
    settings: dict[str, Any] = {"data": str(corpus), "model": model, "block_size": 32, "batch_size": 4,
                                "optimizer": "adamw", "dtype": "bfloat16", "device": "cuda", "max_steps": 6,
                                "out_dir": str(tmp_path / "run")}  # fmt: skip
    try:
        train(config("lm", **settings), verbose=False, hooks=Hooks(on_step=on_step, evaluate=False))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert steps == [1, 2, 3, 4, 5, 6]


@on_cuda
def test_a_gguf_block_linear_on_cuda_equals_its_cpu_self() -> None:
    """Off the CPU a BlockLinear dequantises its blocks (qkv's reader) and multiplies: the exact float32 product,
    and the same rows for a tied embedding, as on the CPU."""
    import numpy as np

    from qkv.quantization import BLOCKS, BlockLinear, Blocks
    from qkv.quantization.ggml import HALVES

    rng = np.random.default_rng(2)
    for kind, (per, size) in BLOCKS.items():
        raw = rng.integers(0, 256, (32, 256 // per, size), dtype=np.uint8)
        for at in HALVES[kind]:
            raw[..., at : at + 2] = rng.uniform(-0.1, 0.1, (32, 256 // per, 1)).astype(np.float16).view(np.uint8)
        linear = BlockLinear(Blocks(kind, torch.from_numpy(raw.reshape(32, -1)), (32, 256)))
        w = linear.dequantize()  # on the CPU: qkv's kernel's rows
        x = torch.randn(3, 256, dtype=torch.float64).float()
        gpu = linear.cuda()
        torch.testing.assert_close(gpu(x.cuda()).cpu(), x @ w.t(), rtol=1e-4, atol=1e-4, msg=kind)
        ids = torch.tensor([0, 31, 7])
        assert torch.equal(gpu.rows(ids.cuda()).cpu(), w[ids]), kind


@on_cuda
def test_qkv_train_cli_on_cuda_writes_a_checkpoint_that_loads(tmp_path: Path, corpus: Path) -> None:
    """`python -m qkv train --device cuda` for 4 steps exits 0; its checkpoint loads on the GPU and the CPU."""
    out = tmp_path / "run"
    args = ["--data", str(corpus), "--device", "cuda", "--max-steps", "4", "--n-layers", "1", "--d-model", "32",
            "--n-heads", "2", "--block-size", "32", "--batch-size", "4", "--eval-interval", "2", "--eval-tokens",
            "500", "--sample-tokens", "20", "--out-dir", str(out)]  # fmt: skip
    env = subprocess_env(PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "qkv", "train", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # The run's first line (on stderr, with the progress bar): CUDA's defaults, bf16 autocast and TF32.
    assert "device cuda:0 (bfloat16 autocast, TF32 matmuls)" in done.stdout + done.stderr
    assert json.loads((out / "config.json").read_text())["training"]["dtype"] == "bfloat16"
    for device in ("cuda", "cpu"):
        trained = load(out, device=device)
        assert next(trained.model.parameters()).device.type == device
        assert len(trained.generate("ROMEO:", max_new_tokens=10, seed=0)) == 10


# --- the GPU check's own dry run (CPU) -----------------------------------------------------------------------


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_stage(tmp_path: Path) -> None:
    """`bash benchmarks/gpu_check.sh --dry-run`: every stage on tiny CPU sizes, one summary table, all PASS."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    table = done.stdout[done.stdout.index("GPU CHECK SUMMARY") :]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| stage")]
    assert [r.split("|")[1].strip() for r in rows] == ["env", "tests", "throughput", "attention", "decode", "fsdp"]
    assert all(r.split("|")[2].strip() == "PASS" for r in rows), table
    assert (tmp_path / "gpu_check.log").read_text().count("GPU CHECK SUMMARY") == 1
