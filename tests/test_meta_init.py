"""Meta-device builds: the replayed initialisation equals the eager build's, bit for bit, sharded or not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import model_cfg
from torch import nn

from qkv.models import DecoderLMConfig, EncoderConfig, QkvConfig, TransformerConfig, build_model
from qkv.training.meta_init import build, build_on_meta, materialise
from qkv.training.recompute import layers_of

D = {"vocab_size": 50, "d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_positions": 64}
CONFIGS: dict[str, QkvConfig] = {
    "gpt-learned-tied": model_cfg(DecoderLMConfig, **D),
    "llama-gqa-rms-untied": model_cfg(DecoderLMConfig, **D, positions="rotary", norm="rms", n_kv_heads=2,
                                      tie_embeddings=False,
                                      activation="swiglu"),
    "sinusoidal-no-bias": model_cfg(DecoderLMConfig, **D, positions="sinusoidal", bias=False),
    "mla-moe": model_cfg(DecoderLMConfig, **D, positions="rotary", attention="mla", moe_experts=4, moe_top_k=2),
    "encoder-decoder-shared": model_cfg(TransformerConfig, src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4,
                                        n_encoder_layers=2, n_decoder_layers=1, d_ff=64,
                                        share_embeddings=True),
    "encoder-decoder-separate": model_cfg(TransformerConfig, src_vocab_size=40, tgt_vocab_size=30, d_model=32,
                                          n_heads=4,
                                          n_encoder_layers=1, n_decoder_layers=2, d_ff=64),
    "bert": model_cfg(EncoderConfig, **D),
}  # fmt: skip


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not), by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_meta_build_materialises_to_the_eager_models_values_and_generator_state(name: str) -> None:
    cfg = CONFIGS[name]
    torch.manual_seed(3)
    eager = build_model(cfg)
    eager_next = torch.rand(5)  # the generator's state after the build, seen through its next draws
    seeded = torch.manual_seed(3).get_state()
    model, plan = build_on_meta(lambda: build_model(cfg))
    assert plan.unsupported is None and plan.writes
    assert all(t.is_meta for t in _tensors(model).values())
    assert torch.equal(torch.random.get_rng_state(), seeded)  # nothing drawn while on meta
    materialise(model, plan, torch.device("cpu"))
    assert torch.equal(torch.rand(5), eager_next)
    got, want = _tensors(model), _tensors(eager)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    # Tied weights stay one tensor.
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert len(list(model.parameters())) == len(list(eager.parameters())) and len(names) == len(
        list(eager.named_parameters(remove_duplicate=False)))


def test_a_build_that_loads_weights_or_draws_otherwise_is_built_eagerly() -> None:
    source = build_model(CONFIGS["gpt-learned-tied"])

    def loads() -> nn.Module:
        model = build_model(CONFIGS["gpt-learned-tied"])
        model.load_state_dict(source.state_dict())
        return model

    model, plan = build(loads, on_meta=True)
    assert plan is None and torch.equal(model.state_dict()["lm_head.weight"], source.state_dict()["lm_head.weight"])
    _, meta_plan = build_on_meta(loads)
    assert meta_plan.unsupported == "weights loaded into the model while it is built"

    class Drawn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

    assert build_on_meta(Drawn)[1].unsupported == "a random tensor made by aten.randn"

    class Buffered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(4.0))

    assert "buffer table of Buffered" in str(build_on_meta(Buffered)[1].unsupported)
    model, plan = build(Buffered, on_meta=True)
    assert plan is None and torch.equal(model.table, torch.arange(4.0))  # type: ignore[arg-type]


def _shard_worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        results = {}
        for name in ("llama-gqa-rms-untied", "encoder-decoder-shared"):
            cfg = CONFIGS[name]
            torch.manual_seed(7)
            model, plan = build(lambda cfg=cfg: build_model(cfg), on_meta=True)
            assert plan is not None
            for layer in layers_of(model):
                fully_shard(layer)
            fully_shard(model)
            materialise(model, plan, torch.device("cpu"))
            local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[operator]
            full = {n: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[operator]
            next_draw = torch.rand(3).tolist()
            torch.manual_seed(7)
            eager = build_model(cfg)
            diff = [n for n, p in eager.named_parameters() if not torch.equal(p, full[n])]
            results[name] = {"diff": diff, "local": local, "total": sum(p.numel() for p in eager.parameters()),
                             "rng_same": torch.rand(3).tolist() == next_draw}  # fmt: skip
        Path(out, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_two_fsdp_ranks_hold_half_of_a_meta_built_model_each_with_the_eager_values(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_shard_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    for name in results[0]:
        per_rank = [r[name] for r in results]
        assert all(r["diff"] == [] and r["rng_same"] for r in per_rank), per_rank
        assert sum(r["local"] for r in per_rank) == per_rank[0]["total"]  # each element on exactly one rank
        assert max(r["local"] for r in per_rank) <= 0.6 * per_rank[0]["total"]
