"""Weight formats for fast decoding: int8 and int4 weight-only quantisation, and input-major float32 matrices.

Decoding one token at a time is bound by memory: each step reads every weight matrix once, and multiplies it by
a single vector. Two ways to read them faster, both applied to a trained model for inference only:

**int8 weights** (`quantize_int8`, `qkv generate --quantize int8`). Storing the weights in 1 byte instead of 4
reads a quarter of the bytes of float32 (half of bfloat16's), and the bytes read bound the step. The
activations stay in floating point (weight-only): only the weights are rounded, which keeps a model's answers
far better than quantising activations too. Each output channel (row of W, shape (N, K)) gets its own scale
s_n = max_k |W_nk| / 127 and stores q_nk = round(W_nk / s_n) in [-127, 127]; then x Wᵀ ≈ (x qᵀ) · s, computed
by PyTorch's own int8 weight-packed matmul kernel (torch._weight_int8pack_mm) on the CPU, with x rounded to
bfloat16 (the kernel's fast path), and by dequantising on the fly elsewhere. A tied output head (the token
embedding matrix used again as the final Linear) gets an int8 copy of its own: that head is the largest matrix
read per token (GPT-2: 50,257 × 768), while the embedding table is only indexed, one row per token, and stays
in floating point.

**Input-major float32** (`input_major`, used by `qkv generate` for one float32 sequence on the CPU). nn.Linear
keeps W as (out, in) and computes x Wᵀ; for a single token the CPU's BLAS reads a float32 matrix faster stored
the other way, as Wᵀ (in, out) row by row (benchmarks/decode.py measures it; docs/speed.md has the figures).
With bfloat16 weights or several sequences the usual layout is as fast or faster. A tied head gets a transposed
copy, which costs the head's size in memory once more.

**int4 weights** (`quantize_int4`, `qkv generate --quantize int4 --group-size G`): each group of G inputs of a row gets
its own scale and minimum (GGUF's Q4_1 form), and qkv.quantization.groups.GroupLinear multiplies the 4-bit codes with
PyTorch's int4 CPU kernel: about an eighth of float32's bytes, with a larger rounding error than int8's.

Linears whose matrix their module reads directly (named in its `float_linears`: MLA's kv_up, which weight
absorption slices per head, and the MoE router) keep their nn.Linear in both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.quantization.blocks import BlockLinear
from qkv.quantization.groups import GroupLinear, exact_head, runs_natively


class Int8Linear(nn.Module):
    """A Linear layer whose weight is int8 with a per-output-channel scale; inputs and outputs stay float."""

    weight_int8: Tensor
    scales: Tensor

    def __init__(self, weight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_int8", weight)  # (N, K); not `weight`: code reading W directly must fail
        self.register_buffer("scales", scales)  # (N,) float
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Round a Linear's weight to int8 per output channel (symmetric: 0 stays exactly 0)."""
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # (N, K)
        dtype = linear.weight.dtype
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scales.to(dtype), bias)

    def forward(self, x: Tensor) -> Tensor:
        """x (…, K) → (…, N): x Wᵀ with W = q · s, returned in x's dtype."""
        flat = x.reshape(-1, self.in_features)  # (M, K)
        if flat.device.type == "cpu" and self.in_features % 16 == 0:
            # The CPU kernel's fast path takes bfloat16 inputs (with float32 ones it is slower than a float32 matmul,
            # benchmarks/decode.py): the product's inputs are rounded to bfloat16, its output cast back.
            # That path needs K to be a multiple of 16 (it crashes otherwise, PyTorch 2.13).
            xb = flat.to(torch.bfloat16).contiguous()
            y = torch._weight_int8pack_mm(xb, self.weight_int8, self.scales.to(torch.bfloat16)).to(x.dtype)
        elif flat.device.type == "cpu":
            y = torch._weight_int8pack_mm(flat.contiguous(), self.weight_int8, self.scales.to(x.dtype))
        else:  # no fused kernel here: dequantise on the fly (correct, not faster)
            y = F.linear(flat, self.weight_int8.to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """Shapes, as nn.Linear shows them."""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, bias={self.bias is not None}"


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Replace every nn.Linear of model (in place, but for its float_linears) by make(linear); for inference."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and name not in getattr(parent, "float_linears", ())]  # fmt: skip
    for parent, name, linear in targets:  # listed first: replacing while walking the tree would skip modules
        setattr(parent, name, make(linear))
    return model.eval().requires_grad_(False)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of model (in place) by an Int8Linear; returns the model, for inference only."""
    return _replace_linears(model, Int8Linear.from_linear)


def quantize_int4(model: nn.Module, group: int = 32) -> nn.Module:
    """Replace every nn.Linear of model (in place) by a 4-bit GroupLinear with a scale and minimum per `group` inputs,
    where the int4 kernel takes its shape (else it stays float); returns the model, for inference only."""
    def make(linear: nn.Linear) -> nn.Module:
        fits = runs_natively((linear.out_features, linear.in_features), group, 4)
        return GroupLinear.from_linear(linear, group) if fits else linear

    _replace_linears(model, make)
    exact_head(model)
    return model


class InputMajorLinear(nn.Module):
    """A Linear layer whose float weight is stored transposed, (in_features, out_features), for inference."""

    weight_t: Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Not named `weight`: code that reads a Linear's W directly must fail here, not get Wᵀ.
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())  # (K, N)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (…, K) → (…, N) = x Wᵀ + b: the same product, summed in BLAS's other order."""
        return F.linear(x, self.weight_t.t(), self.bias)  # W = (Wᵀ)ᵀ is a view: BLAS reads weight_t as stored

    def extra_repr(self) -> str:
        """Shapes, as nn.Linear shows them."""
        return f"in_features={self.in_features}, out_features={self.out_features}, input-major"


def input_major(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of model (in place) by an InputMajorLinear; returns the model, for inference only."""
    return _replace_linears(model, InputMajorLinear)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the matrices a decode step multiplies by (Linear weights, float or int8, and their scales)."""
    total = 0
    for m in model.modules():
        if isinstance(m, GroupLinear | BlockLinear):
            total += m.weight_bytes()
        elif isinstance(m, Int8Linear):
            total += m.weight_int8.numel() + m.scales.numel() * m.scales.element_size()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
