"""Tests for multi-head latent attention (qkv.attention.latent): incremental decoding against the latent cache,
naive vs absorbed decoding, what the cache holds and how big it is, config validation, and training via `qkv train`.

Models are tiny (2 layers, d_model 32) except the cache-size test, which needs the issue's d_model 1024 shape but
only a 1-layer model with a 64-wide FFN and a 16-token vocabulary, decoding 8 tokens.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import model_cfg, with_maps

from qkv.attention import KVCache, LatentAttention, LatentAttentionConfig, LatentKVCache, set_absorb
from qkv.data import load_shakespeare
from qkv.errors import QkvError
from qkv.generation import Sampling, generate
from qkv.models import DecoderLM, DecoderLMConfig

MLA: dict[str, Any] = {"vocab_size": 40, "d_model": 32, "n_heads": 4, "n_layers": 2, "positions": "rotary",
                       "norm": "rms", "activation": "swiglu", "bias": False, "attention": "mla", "kv_lora_rank": 16,
                       "qk_rope_head_dim": 4, "max_positions": 64}  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


def _model(**overrides: Any) -> DecoderLM:
    """A tiny MLA DecoderLM in eval mode."""
    return DecoderLM(model_cfg(DecoderLMConfig, **{**MLA, **overrides})).eval()


def _benchmark() -> Any:
    """benchmarks/kv_cache.py as a module: the test checks the very measurement the report prints."""
    spec = importlib.util.spec_from_file_location("kv_cache_benchmark", ROOT / "benchmarks" / "kv_cache.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("absorb", [False, True])
@torch.no_grad()
def test_incremental_decoding_equals_full_forward(absorb: bool, q_lora_rank: int | None) -> None:
    model = _model(mla_absorb=absorb, q_lora_rank=q_lora_rank)
    ids = torch.randint(0, 40, (2, 14))
    full = model(ids)
    cache = model.new_cache(capacity=4)  # small, so the latent buffer has to grow while decoding
    steps = [model(ids[:, :6], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(6, 14)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5
    assert all(isinstance(layer.self_attn, LatentKVCache) for layer in cache)


@torch.no_grad()
def test_absorbed_equals_naive_with_padding_and_weights() -> None:
    model = _model(q_lora_rank=12)
    ids = torch.randint(0, 40, (2, 10))
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[0, :3] = False  # left padding on the first row
    naive, naive_maps = with_maps(model, ids, padding_mask=padding)
    assert set_absorb(model, True) == 2
    absorbed, absorbed_maps = with_maps(model, ids, padding_mask=padding)
    assert (naive - absorbed).abs().max().item() <= 1e-5
    for w_naive, w_absorbed in zip(naive_maps.self_attn, absorbed_maps.self_attn, strict=True):
        assert w_naive.shape == (2, 4, 10, 10)
        assert (w_naive - w_absorbed).abs().max().item() <= 1e-6
    assert naive_maps.self_attn[0][0, :, :, :3].abs().max().item() == 0.0  # padded keys get no weight


def test_absorbed_and_naive_gradients_agree() -> None:
    ids = torch.randint(0, 40, (2, 9))
    grads = []
    for absorb in (False, True):
        torch.manual_seed(1)
        model = _model(mla_absorb=absorb).train()
        F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
        attn = model.decoder.layers[0].self_attn
        assert isinstance(attn, LatentAttention) and attn.kv_up.weight.grad is not None
        grads.append(attn.kv_up.weight.grad)
    assert (grads[0] - grads[1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("absorb", [False, True])
def test_bf16_autocast_trains_and_caches_bf16(absorb: bool) -> None:
    model = _model(mla_absorb=absorb, q_lora_rank=12)
    ids = torch.randint(0, 40, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
        cache = model.new_cache()
        with torch.no_grad():
            model(ids, cache=cache)
    loss.backward()
    assert torch.isfinite(loss)
    assert cache[0].self_attn.keys_values()[0].dtype == torch.bfloat16  # half the bytes of fp32


@torch.no_grad()
def test_cache_holds_only_latent_rows_and_reorders() -> None:
    model = _model()
    ids = torch.randint(0, 40, (3, 7))
    cache = model.new_cache(capacity=8)
    model(ids, cache=cache)
    layer = cache[0].self_attn
    assert isinstance(layer, LatentKVCache)
    c_kv, k_rope = layer.latents()
    assert c_kv.shape == (3, 1, 7, 16) and k_rope.shape == (3, 1, 7, 4)  # one shared latent "head", no K or V
    assert layer.nbytes() == 3 * 7 * (16 + 4) * 4  # fp32 rows, spare capacity not counted
    keys, values = layer.keys_values()  # the absorbed form: keys [c_KV; k_rope], values c_KV (a view)
    assert keys.shape[-1] == 20 and values.data_ptr() == keys.data_ptr()
    before = c_kv.clone()
    layer.reorder(torch.tensor([2, 0]))
    assert torch.equal(layer.latents()[0], before[[2, 0]])
    with pytest.raises(QkvError, match="self-attention latents"):
        layer.set(c_kv, k_rope)


def test_cached_and_uncached_generation_agree() -> None:
    model = _model(mla_absorb=True)
    prompt = torch.randint(0, 40, (2, 5))
    cached = generate(model, prompt, 12, Sampling(temperature=0.0))
    assert torch.equal(cached, generate(model, prompt, 12, Sampling(temperature=0.0), use_cache=False))


def test_mla_cache_is_at_most_a_seventh_of_mha() -> None:
    bench = _benchmark()
    sizes = bench.cache_bytes_per_token(n_tokens=8)  # d_model 1024, 16 heads of 64, kv_lora_rank 256, 32 RoPE dims
    assert sizes["MHA"] == 2 * 16 * 64 * 4  # K and V, 16 heads of 64, fp32
    assert sizes["GQA"] == sizes["MHA"] // 4 and sizes["MQA"] == sizes["MHA"] // 16
    assert sizes["MLA"] == (256 + 32) * 4  # c_KV and k_rope only
    assert sizes["MLA"] * 7 <= sizes["MHA"]


def test_config_fills_deepseek_v2_defaults() -> None:
    cfg = model_cfg(DecoderLMConfig, vocab_size=10, d_model=64, n_heads=4, positions="rotary", attention="mla")
    mla = cfg.decoder.block.attention
    assert isinstance(mla, LatentAttentionConfig) and mla.sizes(cfg.d_model) == (64, 16, 8, 16)
    assert mla.q_lora_rank is None and cfg.rotary_dim() == 8
    assert DecoderLMConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"attention": "gqa"}, r"unknown decoder.block.attention 'gqa'; choose one of: mha, mla"),
        ({"kv_lora_rank": 8}, r"decoder.block.attention has no field 'kv_lora_rank'"),
        ({"mla_absorb": True}, r"decoder.block.attention has no field 'absorb'"),
        ({"attention": "mla"}, r"attention kind mla needs rotary positions"),
        ({"attention": "mla", "positions": "rotary", "qk_rope_head_dim": 3}, r"qk_rope_head_dim must be even"),
        ({"attention": "mla", "positions": "rotary", "kv_lora_rank": 0}, r"kv_lora_rank must be a positive integer"),
        ({"attention": "mla", "positions": "rotary", "q_lora_rank": -2}, r"q_lora_rank must be a positive integer"),
        ({"attention": "mla", "positions": "rotary", "n_kv_heads": 2}, r"attention has no field 'n_kv_heads'"),
        ({"moe_experts": 6, "moe_groups": 4}, r"groups=4 must divide experts=6"),
        ({"moe_experts": 8, "moe_groups": 4, "moe_topk_groups": 1, "moe_top_k": 3}, r"top_k=3 exceeds the 2"),
        ({"moe_experts": 4, "moe_shared_experts": -1}, r"shared_experts must be an integer ≥ 0"),
    ],
)
def test_config_refuses_bad_mla_and_moe_settings(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(QkvError, match=message):
        model_cfg(DecoderLMConfig, vocab_size=10, d_model=32, n_heads=4, **fields)


def test_latent_attention_refuses_misuse() -> None:
    attn = LatentAttention(32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    x, rope = torch.randn(1, 3, 32), (torch.ones(3, 4), torch.zeros(3, 4))
    assert attn(x, rope=rope).shape == (1, 3, 32)
    with pytest.raises(QkvError, match="needs rotary positions"):
        attn(x)
    with pytest.raises(QkvError, match="self-attention only"):
        attn(x, context=x, rope=rope)
    with pytest.raises(QkvError, match="pass a LatentKVCache"):
        attn(x, cache=KVCache(), rope=rope)


def test_mla_trains_through_qkv_train(tmp_path: Path) -> None:
    from qkv.cli import main

    data = tmp_path / "shakespeare.txt"
    data.write_text(load_shakespeare()[:20_000], encoding="utf-8")  # an excerpt keeps the evaluations quick
    out = tmp_path / "run"
    args = ["train", "--data", str(data), "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--block-size", "32",
            "--batch-size", "8", "--max-steps", "30", "--warmup-steps", "5", "--eval-interval", "10",
            "--sample-tokens", "0", "--device", "cpu", "--out-dir", str(out), "--model", "attention=mla",
            "--model", "kv_lora_rank=16", "--model", "q_lora_rank=16", "--model", "qk_rope_head_dim=8"]  # fmt: skip
    assert main(args) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [10, 20, 30]
    assert metrics[-1]["val_loss"] < metrics[0]["val_loss"] - 0.1
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    saved = json.loads((out / "config.json").read_text())["model"]["decoder"]["block"]["attention"]
    assert (saved["kind"], saved["kv_lora_rank"], saved["q_lora_rank"]) == ("mla", 16, 16)


def test_latent_down_projections_get_the_plain_init_std() -> None:
    """Only projections writing into the residual stream get GPT-2's smaller std; MLA's q/kv_down do not."""
    torch.manual_seed(0)
    model = DecoderLM(model_cfg(DecoderLMConfig, **{**MLA, "d_model": 256, "n_layers": 8, "q_lora_rank": 64}))
    attn = model.decoder.layers[0].self_attn
    assert abs(float(attn.kv_down.weight.detach().std()) - 0.02) < 0.002
    assert abs(float(attn.q_down.weight.detach().std()) - 0.02) < 0.002
    assert abs(float(attn.out_proj.weight.detach().std()) - 0.02 / 4) < 0.001  # 0.02 / √(2 · 8)


def test_moe_block_refuses_groups_of_one_expert() -> None:
    from qkv.blocks.moe import MoEFeedForward

    with pytest.raises(QkvError, match="groups of ≥ 2"):
        MoEFeedForward(8, 16, n_experts=4, top_k=2, n_groups=4, topk_groups=2)
