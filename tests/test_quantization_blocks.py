"""BlockLinear: GGUF matrices kept as the file's bytes and multiplied by qkv's kernel (csrc/ggml_dot.cpp), against a
reference written here from ggml's definitions: the activations rounded to 8-bit blocks as llama.cpp's x86 code
rounds them (q8_0, q8_1, q8_K), times the weights as gguf-py dequantises them, summed in float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quantization_gguf import random_blocks

from qkv.errors import QkvError
from qkv.quantization import BLOCKS, BlockLinear, Blocks, GroupEmbedding, native
from qkv.quantization.blocks import TYPE_IDS

gguf = pytest.importorskip("gguf")  # the `hf` extra; the dev set-up installs it
pytestmark = pytest.mark.skipif(not native.available(), reason="qkv's kernels need a C++ compiler")  # CI has one
KINDS = sorted(BLOCKS)


def rounded(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """x (M, K) float32 as llama.cpp rounds it for a matrix of `kind`: the values it multiplies (M, K), and per block
    of 32 the amount q8_1's float16 sum adds over them (Q4_1's minimums multiply it; zeros for other formats)."""
    m, k = x.shape
    extra = np.zeros((m, k // 32))
    if kind in ("Q4_K", "Q6_K"):  # q8_K: blocks of 256, scale −127 / (the signed value of largest magnitude)
        blocks = x.reshape(m, -1, 256)
        largest = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
        inverse = np.float32(-127) / largest
        codes = np.minimum(127, np.rint(inverse * blocks))
        return (codes * (np.float32(1) / inverse)).reshape(m, k).astype(np.float64), extra
    blocks = x.reshape(m, -1, 32)  # q8_0: d = max|x| / 127 stored as float16, codes round(x · 127 / max|x|)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    codes = np.rint(blocks * inverse)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
    if kind == "Q4_1":  # q8_1 also stores s = d · Σ codes as float16, which the minimums multiply instead
        s = ((amax / np.float32(127))[..., 0] * codes.sum(-1)).astype(np.float16).astype(np.float64)
        extra = s - d[..., 0] * codes.sum(-1)
    return (codes * d).reshape(m, k), extra


def reference(x: np.ndarray, raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """x · Wᵀ as llama.cpp computes it, (M, N) float64, and the sum of the products' magnitudes (for a bound)."""
    n = raw.shape[0]
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, -1).astype(np.float64)
    values, extra = rounded(x, kind)
    y = values @ w.T
    if kind == "Q4_1":  # the minimum of each weight block, float16 at bytes 2–3
        minimum = raw.reshape(n, -1, 20)[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)  # (N, B)
        y += extra @ minimum.T
    return y, np.abs(values) @ np.abs(w.T)


def linear_of(kind: str, n: int, k: int, seed: int, bias: bool = False) -> tuple[BlockLinear, np.ndarray]:
    raw = random_blocks(kind, n, k, seed)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed)) if bias else None
    return BlockLinear(Blocks(kind, torch.from_numpy(raw), (n, k)), b), raw


@pytest.mark.parametrize("kind", KINDS)
def test_each_format_multiplies_as_llama_cpp_rounds_its_activations(kind: str) -> None:
    n, k = 40, 512
    linear, raw = linear_of(kind, n, k, seed=3, bias=True)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(4))
    y = linear(x)
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    expected, magnitude = reference(x.reshape(-1, k).numpy(), raw, kind)
    assert linear.bias is not None
    got = (y.reshape(-1, n) - linear.bias).double().numpy()
    # float32 sums of up to K terms: a few units in the 24th bit of the sum of their magnitudes
    np.testing.assert_array_less(np.abs(got - expected), 2**-20 * magnitude + 1e-30)
    exact = x.reshape(-1, k).double().numpy() @ gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(
        n, -1).T  # fmt: skip
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()  # what rounding the activations costs, roughly


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_the_files_weights_and_take_its_bytes(kind: str) -> None:
    linear, raw = linear_of(kind, 48, 256, seed=5)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(48, 256)
    assert torch.equal(linear.dequantize(), torch.from_numpy(w))  # bit for bit
    ids = torch.tensor([[0, 47, 3], [12, 12, 40]])
    assert torch.equal(GroupEmbedding(linear)(ids), torch.from_numpy(w)[ids])
    assert torch.equal(GroupEmbedding(linear)(ids.int()), torch.from_numpy(w)[ids])  # int32 ids, as nn.Embedding
    assert linear.weight_bytes() == raw.size  # the file's bytes, nothing more


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 40), m=st.integers(1, 19), seed=st.integers(0, 2**31 - 1))
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(kind: str, rows: int, m: int, seed: int) -> None:
    """The kernel takes activation rows eight at a time and weight rows sixteen to a task; a row's outputs must not
    depend on its company, or a served sequence's tokens would depend on who else is decoding."""
    linear, _ = linear_of(kind, rows, 256, seed)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed % 5 - 2)
    together = linear(x)
    assert torch.equal(together, torch.cat([linear(x[i : i + 1]) for i in range(m)]))
    assert torch.equal(together[1:], linear(x[1:]))


@pytest.mark.parametrize("kind", KINDS)
def test_zero_and_non_finite_activations_and_an_empty_batch(kind: str) -> None:
    """Zeros give zeros; a NaN or an infinity gives NaN in every output of its row, as a float product would (a
    diverging model must not go on producing plausible logits); the other rows are untouched."""
    linear, _ = linear_of(kind, 16, 256, seed=1)
    assert torch.equal(linear(torch.zeros(2, 256)), torch.zeros(2, 16))
    assert linear(torch.zeros(0, 256)).shape == (0, 16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    x[0, 7], x[2, 255] = float("nan"), float("-inf")
    y = linear(x)
    assert y[0].isnan().all() and y[2].isnan().all() and torch.equal(y[1], linear(x[1:2])[0])


def test_damaged_blocks_are_refused_in_one_line() -> None:
    raw = torch.from_numpy(random_blocks("Q8_0", 16, 64, 3))
    with pytest.raises(QkvError, match=r"needs 1,088 bytes .* but the file holds 1,087: the file is damaged"):
        BlockLinear(Blocks("Q8_0", raw.flatten()[:-1], (16, 64)))
    raw[2, 34:36] = torch.tensor([np.float16(np.nan)]).view(torch.uint8)
    with pytest.raises(QkvError, match="scale is not a finite number: the file is damaged"):
        BlockLinear(Blocks("Q8_0", raw, (16, 64)))
    with pytest.raises(RuntimeError, match="ggml_mm: 96 inputs do not fill rows of 68 bytes"):
        torch.ops.qkv.ggml_mm(torch.zeros(1, 96), raw, TYPE_IDS["Q8_0"])


def test_the_kernels_build_into_the_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKV_KERNELS", str(tmp_path))
    built = native.library()
    assert built.parent == tmp_path and built.suffix == ".so" and list(tmp_path.iterdir()) == [built]
    stamp = built.stat().st_mtime_ns
    assert native.library() == built and built.stat().st_mtime_ns == stamp  # the second call finds it
    monkeypatch.setenv("CXX", "no-such-compiler-qkv")
    with pytest.raises(OSError, match=r"no C\+\+ compiler \(no-such-compiler-qkv\) on PATH"):
        native.library()


def test_a_pickled_block_linear_multiplies_after_loading(tmp_path: Path) -> None:
    linear, _ = linear_of("Q5_0", 16, 64, seed=4)
    torch.save(linear, tmp_path / "linear.pt")
    back = torch.load(tmp_path / "linear.pt", weights_only=False)
    x = torch.randn(2, 64)
    assert back.kernel and torch.equal(back(x), linear(x))


def _block_model(kinds: tuple[str, ...]) -> torch.nn.Module:
    """A small random Llama-shaped model whose every Linear is a BlockLinear (gguf-py quantises the weights), the
    formats taken in turn from `kinds`."""
    from helpers import model_cfg

    from qkv import DecoderLM, DecoderLMConfig

    torch.manual_seed(7)
    cfg = model_cfg(DecoderLMConfig, vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=128,
                    max_positions=64, positions="rotary", norm="rms", activation="swiglu", bias=False)  # fmt: skip
    model = DecoderLM(cfg).eval()
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, torch.nn.Linear)]  # fmt: skip
    for i, (parent, name, child) in enumerate(linears):
        kind = kinds[i % len(kinds)]
        raw = gguf.quants.quantize(child.weight.detach().numpy() * 3, gguf.GGMLQuantizationType[kind])
        setattr(parent, name, BlockLinear(Blocks(kind, torch.from_numpy(raw), tuple(child.weight.shape))))
    with torch.no_grad():  # the head is its own now: spread the embeddings, or greedy decoding repeats at once
        model.embed.tokens.weight.normal_(0.0, 2.0)
    return model


@pytest.mark.slow
def test_a_block_models_compiled_step_is_one_graph_with_the_eager_tokens() -> None:
    """The kernel is a custom op that Inductor calls from its C++ wrapper; compiled decoding gives the eager tokens
    (the same kernel, the same bits) in one graph."""
    import torch._dynamo

    from qkv.generation import Sampling, stream

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _block_model(("Q8_0", "Q5_0", "Q4_1", "Q4_0"))
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    eager = torch.stack(list(stream(model, prompt, 12, Sampling(temperature=0.0))), 1)
    compiled = torch.stack(list(stream(model, prompt, 12, Sampling(temperature=0.0), compiled=True)), 1)
    assert torch.equal(compiled, eager) and len(set(eager[0].tolist())) > 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_qkv_no_kernels_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """QKV_NO_KERNELS (or no compiler): native.available() is False, and a GGUF's matrices go to PyTorch's int4
    kernel instead (test_quantization_gguf runs SmolLM2 that way)."""
    monkeypatch.setenv("QKV_NO_KERNELS", "1")
    native.available.cache_clear()
    try:
        assert not native.available()
    finally:
        monkeypatch.delenv("QKV_NO_KERNELS")
        native.available.cache_clear()
    assert native.available()



@pytest.mark.parametrize("kind", KINDS)
def test_without_the_kernel_the_module_dequantises_and_multiplies(kind: str) -> None:
    """The path a CUDA tensor takes (and a CPU without the kernels): qkv's reader dequantises the blocks, and the
    product is the exact float one, the rows the kernel's (tests/test_cuda.py runs it on a GPU)."""
    linear, _ = linear_of(kind, 32, 256, seed=6)
    w = linear.dequantize()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    linear.kernel = False
    torch.testing.assert_close(linear(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 31, 7])
    assert torch.equal(linear.rows(ids), w[ids])
