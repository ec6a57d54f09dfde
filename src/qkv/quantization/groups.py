"""Group-quantised weights kept quantised: a Linear (and a tied embedding) over GGUF's 4- to 8-bit codes.

A decode step reads every weight once for one vector, so its speed is the bytes it reads. `GroupLinear` keeps a
GGUF file's codes at their width and multiplies them with PyTorch's group-wise int4 CPU kernel
(`torch.ops.aten._weight_int4pack_mm_for_cpu`). That kernel computes x · Wᵀ for W = (p − 8) · S + Z, with 4-bit
codes p and one scale S and zero Z per group of K, which is GGUF's affine group form (qkv.quantization.ggml):

- codes of at most 4 bits (Q4_0, Q4_1, Q4_K) are one plane: S = scale, Z = minimum + 8 · scale;
- wider codes (Q5_0, Q8_0) are split into a high and a low nibble, c = 16 · hi + lo, and multiplied as two planes:
  S_hi = 16 · scale with Z_hi = 0, and S_lo = scale with Z_lo = minimum + 136 · scale; they sum to c · scale + minimum.
  A high nibble that stays below 8 (Q5_0's is 0 or 1) is stored as hi + 8, so that the kernel's − 8 cancels and
  Z_lo = minimum + 8 · scale: large zeros that cancel would lose the small weights to bfloat16's rounding.

The kernel's fast path takes bfloat16 activations and bfloat16 scales (its float32 path is tens of times slower:
docs/speed.md), so the product's inputs and each group's S and Z are rounded to bfloat16. `dequantize()` gives the
weights the kernel multiplies by, exactly; tests hold the output to x rounded to bfloat16 times those weights.
Off the CPU the planes are unpacked and multiplied in the activations' dtype (correct, not fast).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.quantization.blocks import BlockLinear
from qkv.quantization.ggml import Groups

KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes the int4 kernel takes
EXACT_TOP = 64  # outputs per row that _exact_top may recompute
_SLOTS: dict[tuple[int, int], Tensor] = {}  # (K, rows packed together) → where each weight sits among the nibbles


def runs_natively(shape: tuple[int, int], group: int, bits: int) -> bool:
    """Whether GroupLinear can hold an (N, K) matrix of such groups: a kernel group size, ≤ 8-bit codes, N a
    multiple of 16."""
    n, k = shape
    return group in KERNEL_GROUPS and bits <= 8 and n % 16 == 0 and k % group == 0


def _pack(codes: Tensor) -> Tensor:
    """4-bit codes (N, K) → the CPU kernel's packed layout (N, K / 2) uint8."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def _slots(k: int, block: int) -> Tensor:
    """The kernel interleaves each block of rows; codes that spell each weight's position show where it lands."""
    if (k, block) not in _SLOTS:
        size = block * k
        position = torch.arange(size).view(block, k)
        held = torch.zeros(size, dtype=torch.long)  # slot → the position of the weight it holds
        for digit in range(math.ceil(math.log(size, 16))):
            packed = _pack((position >> (4 * digit)) & 0xF)  # (block, K / 2)
            held |= torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten().long() << (4 * digit)
        slot = torch.empty_like(held)
        slot[held] = torch.arange(size)
        _SLOTS[k, block] = slot.view(block, k)
    return _SLOTS[k, block]


def _unpack(packed: Tensor, rows: Tensor) -> Tensor:
    """The 4-bit codes of these rows, (R, K), from the kernel's packed layout (N, K / 2): blocks of 64 rows, then
    one block of the rest. Branch-free in the rows, so that a compiled step traces it whole."""
    n, k = packed.shape[0], packed.shape[1] * 2
    full = n // 64 * 64

    def codes(start: int, block: int, count: int) -> Tensor:
        r = (rows - start).clamp(0, count - 1)  # rows outside these blocks read a row of theirs, then are dropped
        slot = _slots(k, block).to(rows.device)[r % block]  # (R, K): each weight's nibble in its block
        byte = (start + r // block * block)[:, None] * (k // 2) + slot // 2  # (R, K) into the flat packed bytes
        return ((packed.reshape(-1)[byte] >> (4 * (slot % 2))) & 0xF).to(torch.uint8)  # even slot: the low nibble

    if full == n:
        return codes(0, 64, n)
    if full == 0:
        return codes(0, n, n)
    return torch.where((rows < full)[:, None], codes(0, 64, full), codes(full, n - full, n - full))


class GroupLinear(nn.Module):
    """A Linear whose weight stays group-quantised (one or two 4-bit planes); inputs and outputs stay float."""

    planes: Tensor
    scales_zeros: Tensor
    exact_top = False  # the model's head: each row's largest outputs are recomputed in float32 (see _exact_top)

    def __init__(self, groups: Groups, bias: Tensor | None = None) -> None:
        super().__init__()
        if not runs_natively((groups.codes.shape[0], groups.codes.shape[1]), groups.group, groups.bits):
            raise QkvError(f"group-quantised weights of shape {tuple(groups.codes.shape)}, {groups.bits}-bit codes "
                           f"in groups of {groups.group}, have no int4 kernel; pass --dtype float32")  # fmt: skip
        self.out_features, self.in_features = groups.codes.shape
        self.group, self.bits = groups.group, groups.bits
        s, m = groups.scale.t(), groups.minimum.t()  # (K / g, N)
        if groups.bits <= 4:
            codes, scales, zeros = [groups.codes], [s], [m + 8 * s]
        else:
            shift = 8 if groups.bits < 8 else 0  # a high nibble below 8 is stored + 8: the kernel's − 8 then cancels
            codes, scales = [(groups.codes >> 4) + shift, groups.codes & 0xF], [16 * s, s]
            zeros = [torch.zeros_like(s), m + (136 - 16 * shift) * s]
        self.register_buffer("planes", torch.stack([_pack(c) for c in codes]))  # (P, N, K / 2) uint8
        sz = [torch.stack([a, b], dim=-1) for a, b in zip(scales, zeros, strict=True)]
        # (P, K / g, N, 2) bfloat16, held as its bits (int16): model.to(dtype) casts float buffers, not integer ones.
        self.register_buffer("scales_zeros", torch.stack(sz).to(torch.bfloat16).contiguous().view(torch.int16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = 32) -> GroupLinear:
        """Round a float Linear's weight to 4-bit codes, each group of `group` inputs with its own scale and minimum
        (asymmetric, as GGUF's Q4_1): w ≈ code · (max − min) / 15 + min."""
        w = linear.weight.detach().float()
        n, k = w.shape
        blocks = w.view(n, k // group, group)  # (N, K / g, g)
        low, high = blocks.amin(-1), blocks.amax(-1)  # (N, K / g)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((blocks - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(Groups(codes.view(n, k), scale, low, group, 4), linear.bias)

    def rows(self, index: Tensor) -> Tensor:
        """Rows of the weight matrix as the kernel sees them, float32 (…, K): a tied embedding's lookup."""
        flat = index.reshape(-1)
        total = torch.zeros(flat.numel(), self.in_features, device=flat.device)
        for plane, sz in zip(self.planes, self.scales_zeros.view(torch.bfloat16), strict=True):
            codes = _unpack(plane, flat).float().view(flat.numel(), -1, self.group)  # (R, K / g, g)
            s, z = sz[:, flat].float().unbind(-1)  # (K / g, R) each
            total += ((codes - 8) * s.t()[..., None] + z.t()[..., None]).flatten(1)
        return total.view(*index.shape, self.in_features)

    def dequantize(self) -> Tensor:
        """The whole weight matrix as the kernel multiplies by it, float32 (N, K)."""
        return self.rows(torch.arange(self.out_features, device=self.planes.device))

    def forward(self, x: Tensor) -> Tensor:
        """x (…, K) → (…, N): x Wᵀ (+ b), summed over the planes, returned in x's dtype."""
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if flat.device.type == "cpu":
            xb = flat.to(torch.bfloat16).contiguous()
            y = sum(torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, self.group, sz)
                    for p, sz in zip(self.planes, self.scales_zeros.view(torch.bfloat16), strict=True))  # fmt: skip
            # bfloat16 inputs take bfloat16 outputs: recomputing their top would be rounded away again
            y = self._exact_top(xb, y.float()) if self.exact_top and x.dtype == torch.float32 else y
            y = y.to(x.dtype)
        else:
            y = F.linear(flat, self.dequantize().to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _exact_top(self, xb: Tensor, y: Tensor) -> Tensor:
        """y (M, N) with every output within 2 bfloat16 steps of its row's largest recomputed in float32.

        The kernel returns bfloat16, whose 8 significant bits make a head's top logits tie exactly (a gap of 0 at
        logits near 20 is common), and greedy decoding then picks by rounding. An output more than 2 steps below
        its row's largest cannot be the largest in float32, so recomputing the few near the top (their rows of W,
        exactly as the kernel multiplies them) gives float32's choice and top log-probabilities.
        """
        values, index = y.topk(min(EXACT_TOP, y.shape[-1]), dim=-1)  # (M, k): a flat row recomputes k, not all
        near = values >= values[:, :1] - values[:, :1].abs() * 2**-6  # 2**-6: 2 steps of 8 significant bits
        # Summed in float64: the rounded float32 result does not depend on how many outputs are recomputed (a sum's
        # order may), so a row's logits are the same alone and in a batch, and (but for float64's order) in both
        # branches.
        if torch.compiler.is_compiling():  # all k, kept where near: a data-dependent count would break the graph
            exact = (self.rows(index).double() * xb[:, None].double()).sum(dim=-1).float()  # (M, k)
            return y.scatter(1, index, torch.where(near, exact, values))
        row, col = near.nonzero(as_tuple=True)[0], index[near]  # eager: only the few near the top
        y[row, col] = (self.rows(col).double() * xb[row].double()).sum(dim=-1).float()
        return y

    def weight_bytes(self) -> int:
        """Bytes the product reads: the packed planes and their scales and zeros."""
        return self.planes.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def extra_repr(self) -> str:
        """Shapes, as nn.Linear shows them."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit codes in groups "
                f"of {self.group}, bias={self.bias is not None}")  # fmt: skip


def exact_head(model: nn.Module) -> None:
    """Mark a quantised `lm_head` to give float32's top logits (GroupLinear._exact_top); other models: no change."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, GroupLinear):
        head.exact_top = True


class GroupEmbedding(nn.Module):
    """A token embedding read from a quantised Linear's rows: the tied head's quantised matrix embeds too."""

    def __init__(self, table: GroupLinear | BlockLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: Tensor) -> Tensor:
        """ids (…) → vectors (…, d), float32."""
        return self.table.rows(ids)
