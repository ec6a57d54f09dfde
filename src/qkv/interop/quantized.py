"""A checkpoint's quantised matrices put into a built model: a quantised Linear for each Linear, GroupEmbedding for
a token table over the same module (qkv.quantization).

On a CPU where qkv's kernels build, every matrix becomes a BlockLinear over the file's own bytes, multiplied as
llama.cpp multiplies them; otherwise a GroupLinear over PyTorch's int4 kernel, where its group sizes fit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from qkv.interop.checkpoint import Checkpoint
from qkv.interop.hf_io import NameMap, Ref
from qkv.quantization import BlockLinear, Blocks, GroupEmbedding, GroupLinear, exact_head, native, runs_natively


def _plain(ref: Ref) -> bool:
    """Whether the checkpoint tensor is the qkv tensor as it is (no transpose, slice or leading row)."""
    return not (ref.transposed or ref.parts > 1 or ref.row)


def _quantized(ckpt: Checkpoint, name_map: NameMap, qkv_name: str, own: bool) -> Blocks | None:
    """The blocks that hold this qkv weight, when the checkpoint kept them and a kernel multiplies them (`own`:
    qkv's kernels, which take every format)."""
    ref = name_map.get(qkv_name)
    blocks = ckpt.quantized.get(ref.name) if ref is not None and _plain(ref) else None
    fits = blocks is not None and (own or runs_natively(blocks.shape, blocks.group, blocks.bits))
    return blocks if fits else None


def place_quantized(model: nn.Module, ckpt: Checkpoint, name_map: NameMap) -> set[str]:
    """Swap in quantised modules where the checkpoint kept a matrix quantised; returns the names their tensors have in
    the model's state (filled: load_mapped skips them). A bias they took leaves the checkpoint's float tensors.

    Without qkv's kernels, a matrix the int4 kernel cannot take (Q6_K's groups of 16, a row count that is not a
    multiple of 16) is dequantised into the checkpoint's float tensors instead, for load_mapped to read.
    """
    done: set[str] = set()
    own = native.available()
    built: dict[str, BlockLinear | GroupLinear] = {}  # HF name → module: a tied head and its embedding share one
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            blocks = _quantized(ckpt, name_map, f"{full}.weight", own)
            if blocks is None or not isinstance(child, nn.Linear | nn.Embedding):
                continue
            hf = name_map[f"{full}.weight"].name
            bias: Tensor | None = None
            if isinstance(child, nn.Linear) and child.bias is not None:
                bias = ckpt.tensors.pop(name_map[f"{full}.bias"].name)
            if hf not in built:
                built[hf] = BlockLinear(blocks, bias) if own else GroupLinear(blocks.read(), bias)
            table = built[hf]
            module = table if isinstance(child, nn.Linear) else GroupEmbedding(table)
            setattr(parent, name, module)
            done.update(module.state_dict(prefix=f"{full}."))
    for hf, blocks in ckpt.quantized.items():
        if hf not in built:
            ckpt.tensors[hf] = blocks.read().dequantize()
    exact_head(model)
    return done


def materialise(model: nn.Module) -> None:
    """Give the tensors still on the meta device (a model built there, its quantised modules already real) CPU
    storage, and recompute what modules derive rather than load (rotary tables) with their reset_parameters."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, BlockLinear | GroupLinear):
                continue
            for name, param in list(module.named_parameters(recurse=False)):
                if param.is_meta:
                    setattr(module, name, nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad))
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device="cpu")
            if type(module).__module__.startswith("qkv.") and hasattr(module, "reset_parameters"):
                module.reset_parameters()  # type: ignore[operator]


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "zeros_",
          "ones_", "constant_")  # fmt: skip


@contextlib.contextmanager
def skipped_init() -> Iterator[None]:
    """Modules built inside draw no initial values (their weights come from the checkpoint): on the meta device
    torch.nn.init's random draws would import torch's compiler, tens of MB that loading a model has no use for."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)
