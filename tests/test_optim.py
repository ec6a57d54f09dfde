"""The optimisers (qkv.training.optim): Muon's orthogonalisation, its step against torch.optim.Muon, who gets Muon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import config, model_cfg
from torch import nn

from qkv import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig
from qkv.errors import QkvError
from qkv.training.optim import MuonAdamW, block_matrices, make_optimizer, orthogonalize


@pytest.mark.parametrize("shape", [(3, 16, 48), (3, 48, 16), (2, 24, 24)])
def test_orthogonalize_gives_nearly_orthogonal_matrices(shape: tuple[int, int, int]) -> None:
    """Singular values end near 1 (Jordan's quintic leaves them in about [0.7, 1.2]), directions kept.

    A random square matrix has a few singular values near 0, which five iterations cannot lift all the way.
    """
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(g)
    assert o.shape == g.shape and o.dtype == g.dtype
    singular = torch.linalg.svdvals(o)
    assert singular.max() < 1.25 and singular.median() > 0.8
    assert (singular > 0.6).float().mean() > (0.9 if shape[1] == shape[2] else 0.999)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh  # the exact nearest semi-orthogonal matrix
    cosine = (o * polar).sum(dim=(-2, -1)) / (o.norm(dim=(-2, -1)) * polar.norm(dim=(-2, -1)))
    assert cosine.min() > 0.97


def _muon_pair(lr: float, decay: float) -> tuple[list[nn.Parameter], list[nn.Parameter], MuonAdamW, torch.optim.Muon]:
    """The same three matrices under qkv's Muon and under PyTorch's (Moonshot's RMS-matched step)."""
    generator = torch.Generator().manual_seed(1)
    ours = [nn.Parameter(torch.randn(*s, generator=generator)) for s in ((16, 48), (48, 16), (16, 48))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    group = {"params": ours, "muon": True, "momentum": 0.95, "weight_decay": decay}
    return (
        ours,
        theirs,
        MuonAdamW([group], lr=lr),
        torch.optim.Muon(
            theirs, lr=lr, weight_decay=decay, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw"
        ),
    )


def test_muon_steps_like_torch_optim_muon() -> None:
    """Three steps: the same momentum, Nesterov look-ahead, RMS-matched scale and decoupled decay as PyTorch's
    Muon; its Newton–Schulz runs in bfloat16 and qkv's in float32 on a CPU, hence the tolerance."""
    ours, theirs, ours_opt, theirs_opt = _muon_pair(lr=0.02, decay=0.1)
    start = [p.detach().clone() for p in ours]
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        ours_opt.step()
        theirs_opt.step()
        assert all(p.grad is None for p in ours)  # Muon took the gradients; AdamW's step skipped them
    for a, b, s in zip(ours, theirs, start, strict=True):
        moved, expected = a.detach() - s, b.detach() - s
        assert (moved - expected).norm() / expected.norm() < 0.02
    state = ours_opt.state_dict()["state"]
    assert all(set(s) == {"momentum_buffer", "step"} and s["step"] == 3 for s in state.values())


def _tiny_transformer() -> Transformer:
    cfg = model_cfg(TransformerConfig, src_vocab_size=50, tgt_vocab_size=50, d_model=16, n_heads=2, d_ff=32,
                    n_encoder_layers=2,
                    n_decoder_layers=1, share_embeddings=True, dropout=0.0)  # fmt: skip
    return Transformer(cfg)


@pytest.mark.parametrize("model", ["transformer", "decoder_lm"])
def test_muon_takes_the_block_matrices_and_adamw_the_rest(model: str) -> None:
    net: nn.Module = _tiny_transformer()
    if model == "decoder_lm":
        net = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=50, d_model=16, n_heads=2, n_layers=2, max_positions=8))
    optimizer = make_optimizer(net, config("translate", optimizer="muon").optim)
    muon, decay, no_decay = optimizer.param_groups
    names = {id(p): n for n, p in net.named_parameters()}
    muon_names = sorted(names[id(p)] for p in muon["params"])
    assert muon["muon"] and muon_names and all(".layers." in n and n.endswith(".weight") for n in muon_names)
    assert all(p.dim() == 2 for p in muon["params"])
    assert {n.rsplit(".", 2)[-2] for n in muon_names} >= {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert all("layers" not in names[id(p)] for p in decay["params"])  # embeddings and the output layer
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(names)  # every parameter exactly once (tied ones once)
    assert block_matrices(net) == muon["params"]


def test_adamw_groups_of_muon_step_exactly_like_adamw() -> None:
    """The parameters Muon does not take get torch's AdamW step, bit for bit (the twin's matrices: Muon alone)."""
    torch.manual_seed(3)
    net, twin = _tiny_transformer(), _tiny_transformer()
    twin.load_state_dict(net.state_dict())
    hybrid = make_optimizer(net, config("translate", optimizer="muon", fused_optimizer=False).optim)
    lr, decay = hybrid.defaults["lr"], hybrid.param_groups[0]["weight_decay"]
    matrices = block_matrices(twin)
    rest = [p for p in twin.parameters() if all(p is not m for m in matrices)]
    plain = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": decay},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=lr, betas=hybrid.defaults["betas"], foreach=True)  # fmt: skip
    muon_alone = MuonAdamW([{"params": matrices, "muon": True, "momentum": 0.95, "weight_decay": decay}], lr=lr)
    src, tgt = torch.randint(3, 50, (4, 7)), torch.randint(3, 50, (4, 6))
    for _ in range(3):
        for m, optimizers in ((net, [hybrid]), (twin, [plain, muon_alone])):
            m(src, tgt).square().mean().backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters(), strict=True))


def test_the_language_model_and_translation_recipes_use_muon() -> None:
    """Muon is the default of both (with FSDP too: tests/test_tasks.py trains every task sharded like one process)."""
    assert config("lm").optim.name == "muon" and config("translate").optim.name == "muon"
    assert config("lm", optimizer="muon", strategy="fsdp").system.strategy == "fsdp"
    with pytest.raises(QkvError, match="--optimizer must be one of adamw, muon, got 'sgd'"):
        config("lm", optimizer="sgd")


def _sharded_muon_worker(rank: int, store: str, out: str) -> None:
    """One of 2 gloo processes: 3 Muon steps replicated and sharded by owner, from the same weights and gradients."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        shapes = [(16, 32)] * 5 + [(32, 16)] * 3  # an odd count per shape: rank 0 owns one matrix more
        start = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
        final, counts = {}, {}
        for shard in (False, True):
            params = [torch.nn.Parameter(w.clone()) for w in start]
            opt = MuonAdamW([{"params": params, "muon": True, "momentum": 0.95, "weight_decay": 0.1, "shard": shard}],
                            lr=0.02)  # fmt: skip
            for step in range(3):
                for i, p in enumerate(params):  # the same (all-reduced) gradient on every rank, as under DDP
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
                opt.step()
            final[shard] = torch.cat([p.detach().flatten() for p in params])
            counts[shard] = opt.orthogonalized
        diff = float((final[True] - final[False]).abs().max())
        Path(out, f"{rank}.json").write_text(json.dumps({"diff": diff, "counts": counts[True],
                                                         "replicated": counts[False]}))  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_sharded_muon_equals_replicated_muon_with_each_matrix_orthogonalised_on_one_rank(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_sharded_muon_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["diff"] <= 1e-6 for r in results)
    # 8 matrices × 3 steps: replicated, every rank orthogonalises all 24; sharded, rank 0 owns 3 + 2 and rank 1
    # owns 2 + 1 of them per step, so each matrix's Newton–Schulz ran on exactly one rank.
    assert [r["replicated"] for r in results] == [24, 24]
    assert [r["counts"] for r in results] == [15, 9]
