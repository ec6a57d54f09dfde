"""The optimisers: AdamW with weight decay on matrices only, or Muon for the blocks' matrices and AdamW for the rest.

Muon (Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks") replaces each hidden
matrix's update by the nearest semi-orthogonal matrix to its Nesterov momentum: every direction of the update
gets the same step size, however small its gradient was. Embeddings, the output layer, norms and biases keep
AdamW, as in Jordan's recipe. The orthogonalisation is five Newton–Schulz iterations, batched over matrices of
one shape; its step is scaled so that its RMS matches AdamW's (Liu et al., 2025, "Muon is Scalable for LLM
Training"), so AdamW's learning rate and weight decay carry over. PyTorch's own torch.optim.Muon runs the
iterations in bfloat16, matrix by matrix, which is slow on CPUs; on CUDA this one uses bfloat16 as well.
With several processes the orthogonalisation is sharded by owner, as nanochat's Muon is: matrix i of a shape is
orthogonalised by rank i mod N alone, and one all-gather per shape shares the results (shard=False: every rank
orthogonalises every matrix, the same result). Under FSDP each rank holds a slice of every matrix: the update is
gathered whole, orthogonalised by its owner, and each rank applies its own slice of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkv.blocks import DecoderLayer, EncoderLayer
from qkv.training.config import OptimConfig

MUON_MOMENTUM = 0.95
NEWTON_SCHULZ_STEPS = 5
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # Jordan's quintic: steepest at 0 while still converging near 1


def orthogonalize(updates: Tensor, steps: int = NEWTON_SCHULZ_STEPS) -> Tensor:
    """(N, A, B) matrices → approximately their nearest semi-orthogonal ones (U Vᵀ of each SVD U S Vᵀ).

    Newton–Schulz iterations X ← aX + (b XXᵀ + c (XXᵀ)²) X push every singular value towards 1 (to within
    about ±0.3, which Muon does not need finer) once X is scaled so that none exceeds 1.
    """
    a, b, c = NEWTON_SCHULZ
    dtype = torch.bfloat16 if updates.is_cuda else torch.float32  # bfloat16 matmuls are slow on many CPUs
    tall = updates.shape[-2] > updates.shape[-1]
    x = (updates.mT if tall else updates).to(dtype)  # (N, short side, long side): the Gram matrix is the small one
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)  # the Frobenius norm bounds every singular value
    for _ in range(steps):
        gram = x @ x.mT  # (N, short, short)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(updates.dtype)


class MuonAdamW(torch.optim.AdamW):
    """AdamW, whose param groups marked muon=True take Muon's step instead.

    Muon's parameters hand their gradients over (step() sets them to None), so AdamW's step skips them;
    their state is a momentum buffer and a step count each, in the same state dict as AdamW's moments.
    """

    orthogonalized = 0  # matrices this process has orthogonalised so far (each once, on one rank, when sharded)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step for the muon groups, then AdamW's for the others."""
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)
        return super().step(closure)

    def _muon_step(self, group: dict[str, Any]) -> None:
        """Nesterov momentum, orthogonalised per matrix (batched by shape), with decoupled weight decay."""
        momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        steps = group.get("ns_steps", NEWTON_SCHULZ_STEPS)
        by_shape: dict[torch.Size, list[tuple[Tensor, Tensor]]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                # A step count as AdamW's parameters have (a tensor), which AdamW's load_state_dict expects of all
                state["step"], state["momentum_buffer"] = torch.tensor(0.0), torch.zeros_like(p)
            state["step"] += 1
            buffer = state["momentum_buffer"]
            buffer.lerp_(p.grad, 1 - momentum)
            by_shape.setdefault(p.shape, []).append((p, p.grad.lerp_(buffer, momentum)))  # Nesterov's look-ahead
            p.grad = None
        for shape, items in by_shape.items():
            updates = [whole(update) for _, update in items]
            orthogonal = self._orthogonalize(updates, steps, group.get("shard", True))
            scale = 0.2 * math.sqrt(max(shape))  # an update of RMS 0.2, AdamW's typical (Liu et al.)
            for (p, _), update in zip(items, orthogonal, strict=True):
                local = p.to_local() if hasattr(p, "to_local") else p  # FSDP: this rank's shard of the matrix
                local.mul_(1 - lr * decay).add_(own_shard(update, p), alpha=-lr * scale)


    def _orthogonalize(self, updates: list[Tensor], steps: int, shard: bool) -> list[Tensor]:
        """Each update orthogonalised: on its owner rank (i mod N) alone when sharded, shared by an all-gather."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world == 1 or not shard:
            self.orthogonalized += len(updates)
            return list(orthogonalize(torch.stack(updates), steps))
        rank, n = dist.get_rank(), len(updates)
        per_rank = -(-n // world)
        mine = updates[rank::world]
        self.orthogonalized += len(mine)
        local = torch.zeros(per_rank, *updates[0].shape, dtype=updates[0].dtype, device=updates[0].device)
        if mine:
            local[: len(mine)] = orthogonalize(torch.stack(mine), steps)
        shared = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shared, local)  # (per_rank, A, B) from every rank
        return [shared[i % world][i // world] for i in range(n)]


def whole(t: Tensor) -> Tensor:
    """The whole matrix: a plain tensor as it is, an FSDP-sharded one (DTensor) gathered from every rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def own_shard(full: Tensor, like: Tensor) -> Tensor:
    """The rows of `full` that this rank holds of `like` (FSDP shards dim 0 as torch.chunk does), or all of it."""
    if not hasattr(like, "device_mesh"):
        return full
    mesh = like.device_mesh
    chunks = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else full[:0]


def block_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The hidden matrices Muon trains: the 2-D weights of the encoder and decoder layers (attention, FFN)."""
    layers = [m for m in model.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]
    found = {id(p): p for layer in layers for p in layer.parameters() if p.dim() == 2 and p.requires_grad}
    return list(found.values())


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW (decay on matrices only) or, with cfg.name "muon", Muon for the block matrices and AdamW after.

    PyTorch's fused AdamW kernel runs where it has one and cfg.fused asks.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    muon = block_matrices(model) if cfg.name == "muon" else []
    taken = {id(p) for p in muon}
    adamw = [p for p in params if id(p) not in taken]
    groups: list[dict[str, Any]] = [
        {"params": [p for p in adamw if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in adamw if p.dim() < 2], "weight_decay": 0.0},
    ]
    kind: type[torch.optim.AdamW] = torch.optim.AdamW
    if muon:
        groups.insert(0, {"params": muon, "weight_decay": cfg.weight_decay, "muon": True, "momentum": MUON_MOMENTUM,
                          "ns_steps": cfg.newton_schulz_steps})  # fmt: skip
        kind = MuonAdamW
    if cfg.fused:
        try:
            return kind(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)
        except (RuntimeError, TypeError):
            pass  # no fused kernel for this device or dtype
    return kind(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings but its parameters: what this run's config made (kernels, decay, betas, …)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def apply_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Lay group_settings of a fresh optimizer over the groups a resumed state brought back (its moments stay)."""
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
