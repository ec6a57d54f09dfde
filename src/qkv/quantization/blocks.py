"""A Linear over a GGUF matrix's own blocks, multiplied as llama.cpp multiplies them (qkv's kernel, csrc/ggml_dot.cpp).

`BlockLinear` keeps the file's bytes as they are, so its weights take exactly the file's tensor bytes, in any of
the formats qkv.quantization.ggml reads (Q6_K's groups of 16 included, which PyTorch's int4 kernel refuses). On the
CPU its product rounds the activations to 8-bit blocks as llama.cpp does and sums int8 × int8 pairs: x · Wᵀ equals
round(x) · dequantise(W) to float rounding, where round(x) moves each activation by up to half of 1/127 of its
block's largest (docs/speed.md measures what that costs); Q4_1's minimums multiply each block's sum of the rounded
activations as llama.cpp stores it, in float16. Off the CPU, or where the kernels cannot be built, the weights are
dequantised and multiplied in the activations' dtype (correct, not fast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.quantization import native
from qkv.quantization.ggml import BLOCKS, Blocks, check_blocks, read_blocks

TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}  # ggml's ids, as the kernel takes them


class BlockLinear(nn.Module):
    """A Linear whose weight is a GGUF matrix's blocks, bytes as in the file; inputs and outputs stay float."""

    blocks: Tensor

    def __init__(self, source: Blocks, bias: Tensor | None = None) -> None:
        super().__init__()
        check_blocks(source.kind, source.raw, source.shape)  # a damaged matrix is refused here, in one line
        self.kind = source.kind
        self.out_features, self.in_features = source.shape
        raw = source.raw.reshape(self.out_features, -1)  # (N, row bytes): every row is whole blocks
        raw = raw if source.rows is None else raw[source.rows]
        self.register_buffer("blocks", raw.clone().contiguous())  # its own memory: the file may be closed
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.kernel = native.available()  # a plain bool: torch.compile reads it as a constant

    def __setstate__(self, state: dict) -> None:
        """An unpickled module loads the kernels in its own process."""
        super().__setstate__(state)
        self.kernel = native.available()

    def rows(self, index: Tensor) -> Tensor:
        """Rows of the weight matrix, float32 (…, K): a tied embedding's lookup."""
        flat = index.reshape(-1).long()
        if self.kernel and self.blocks.device.type == "cpu":
            out = torch.ops.qkv.ggml_rows(self.blocks, flat, TYPE_IDS[self.kind], self.in_features)
        else:
            out = read_blocks(self.kind, self.blocks[flat], (flat.numel(), self.in_features)).dequantize()
        return out.view(*index.shape, self.in_features)

    def dequantize(self) -> Tensor:
        """The whole weight matrix, float32 (N, K)."""
        return self.rows(torch.arange(self.out_features, device=self.blocks.device))

    def forward(self, x: Tensor) -> Tensor:
        """x (…, K) → (…, N): x Wᵀ (+ b), returned in x's dtype."""
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if self.kernel and flat.device.type == "cpu":
            y = torch.ops.qkv.ggml_mm(flat.float(), self.blocks, TYPE_IDS[self.kind]).to(x.dtype)
        else:
            y = F.linear(flat, self.dequantize().to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes the product reads: the file's blocks."""
        return self.blocks.numel()

    def extra_repr(self) -> str:
        """Shapes, as nn.Linear shows them."""
        per_block, size = BLOCKS[self.kind]
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} ({size} bytes per "
                f"{per_block} weights), bias={self.bias is not None}")  # fmt: skip
