"""Weight formats for fast decoding: int8 per channel, GGUF's blocks kept as the file has them, and input-major
float32 matrices (qkv.quantization.linears, .ggml, .blocks, .groups; qkv's own kernels in .native)."""

from qkv.quantization.blocks import BlockLinear
from qkv.quantization.ggml import BLOCKS, Blocks, Groups, read_blocks
from qkv.quantization.groups import GroupEmbedding, GroupLinear, exact_head, runs_natively
from qkv.quantization.linears import (
    InputMajorLinear,
    Int8Linear,
    input_major,
    quantize_int4,
    quantize_int8,
    weight_bytes,
)

__all__ = ["BLOCKS", "BlockLinear", "Blocks", "GroupEmbedding", "GroupLinear", "Groups", "InputMajorLinear",
           "Int8Linear", "exact_head", "input_major", "quantize_int4", "quantize_int8", "read_blocks",
           "runs_natively", "weight_bytes"]  # fmt: skip
