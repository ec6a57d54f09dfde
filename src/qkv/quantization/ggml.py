"""GGUF's block formats, read into one form: integer codes with a scale and a minimum per group of weights.

llama.cpp stores a quantised matrix row by row, each row cut into blocks along the input dimension K. A block
holds its codes and the numbers that turn them back into weights. Every format qkv runs natively is *affine per
group*: within a group of g consecutive weights of a row, w = code · scale + minimum, with unsigned codes.

| format | block | bits per code | group | weight |
|---|---|---|---|---|
| Q4_0 | 32 weights, 18 bytes | 4 | 32 | d · (q − 8) |
| Q4_1 | 32 weights, 20 bytes | 4 | 32 | d · q + m |
| Q5_0 | 32 weights, 22 bytes | 5 | 32 | d · (q − 16) |
| Q8_0 | 32 weights, 34 bytes | 8 (signed) | 32 | d · q |
| Q4_K | 256 weights, 144 bytes | 4 | 32 | d · sc · q − dmin · m (sc, m: 6-bit, per group) |
| Q6_K | 256 weights, 210 bytes | 6 | 16 | d · sc · (q − 32) (sc: int8, per group) |

The layouts follow ggml-common.h and ggml-quants.c (`dequantize_row_*`); tests hold the result equal to
gguf-py's own `gguf.quants.dequantize`, an independent implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.errors import QkvError

# name: (weights per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144),
          "Q6_K": (256, 210)}  # fmt: skip
GROUPS = {"Q6_K": (16, 6), "Q8_0": (32, 8), "Q5_0": (32, 5)}  # name: (group, bits) where not (32, 4)
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}  # float16 fields


@dataclass
class Groups:
    """A quantised (N, K) matrix: w[n, k] = codes[n, k] · scale[n, k // group] + minimum[n, k // group]."""

    codes: Tensor  # (N, K) uint8, unsigned codes below 2**bits
    scale: Tensor  # (N, K // group) float32
    minimum: Tensor  # (N, K // group) float32
    group: int
    bits: int

    def dequantize(self) -> Tensor:
        """The float32 weights, (N, K)."""
        n, k = self.codes.shape
        w = self.codes.float().view(n, k // self.group, self.group)
        return (w * self.scale[..., None] + self.minimum[..., None]).view(n, k)

    def rows(self, index: Tensor) -> Groups:
        """The groups of these rows (llama.cpp's converter permutes q/k rows; qkv puts them back)."""
        return Groups(self.codes[index], self.scale[index], self.minimum[index], self.group, self.bits)


@dataclass
class Blocks:
    """A matrix in a GGUF block format as the file holds it, read into Groups only when used (one at a time)."""

    kind: str
    raw: Tensor  # uint8, the file's bytes (a view of the mapped file)
    shape: tuple[int, int]  # (N, K)
    rows: Tensor | None = None  # an order of the rows to read them in (llama.cpp permutes q/k rows)

    @property
    def group(self) -> int:
        """Weights per scale."""
        return GROUPS.get(self.kind, (32, 4))[0]

    @property
    def bits(self) -> int:
        """Bits per code."""
        return GROUPS.get(self.kind, (32, 4))[1]

    def read(self) -> Groups:
        """The codes, scales and minimums."""
        groups = read_blocks(self.kind, self.raw, self.shape)
        return groups if self.rows is None else groups.rows(self.rows)


def _half(raw: Tensor, at: int) -> Tensor:
    """The float16 stored at byte `at` of every block, (N, B) float32."""
    return raw[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: Tensor) -> Tensor:
    """16 bytes → 32 codes: the low nibbles are weights 0–15 of the block, the high ones 16–31. (…, 32)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits(raw: Tensor, count: int) -> Tensor:
    """Little-endian bits of the bytes `raw` (…, count // 8) → (…, count) of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)
    return ((raw[..., :, None] >> shifts) & 1).reshape(*raw.shape[:-1], count)


def _scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's 12 bytes → 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4). (…, 8) each."""
    q = scales.to(torch.int32)
    low_sc, low_m = q[..., 0:4] & 63, q[..., 4:8] & 63
    high_sc = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    high_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1).float(), torch.cat([low_m, high_m], -1).float()


def _q6_k(raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q6_K blocks (N, B, 210) → codes (N, B·256), scale and minimum (N, B·16)."""
    ql, qh, sc, d = raw[..., :128], raw[..., 128:192], raw[..., 192:208].contiguous().view(torch.int8), _half(raw, 208)
    halves = []
    for h in range(2):  # each half of the block: 128 weights from 64 ql bytes and 32 qh bytes
        low, high = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
        first, second = low[..., :32], low[..., 32:]  # the low 4 bits of weights 0–31 (then 64–95), 32–63 (96–127)
        parts = [(first & 0xF) | ((high & 3) << 4), (second & 0xF) | (((high >> 2) & 3) << 4),
                 (first >> 4) | (((high >> 4) & 3) << 4), (second >> 4) | (((high >> 6) & 3) << 4)]  # fmt: skip
        halves.append(torch.cat(parts, dim=-1))  # (N, B, 128)
    codes = torch.cat(halves, dim=-1)  # (N, B, 256)
    scale = d[..., None] * sc.float()  # (N, B, 16)
    return codes.flatten(1), scale.flatten(1), (-32 * scale).flatten(1)


def _read(kind: str, raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Blocks (N, B, bytes) of one format → codes (N, K), scale and minimum (N, K // group)."""
    if kind == "Q6_K":
        return _q6_k(raw)
    d = _half(raw, 0)  # (N, B)
    if kind == "Q4_0":
        return _nibbles(raw[..., 2:18]).flatten(1), d, -8 * d
    if kind == "Q4_1":
        return _nibbles(raw[..., 4:20]).flatten(1), d, _half(raw, 2)
    if kind == "Q5_0":
        codes = _nibbles(raw[..., 6:22]) | (_bits(raw[..., 2:6], 32) << 4)
        return codes.flatten(1), d, -16 * d
    if kind == "Q8_0":
        codes = (raw[..., 2:34].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return codes.flatten(1), d, -128 * d
    # Q4_K: 4 chunks of 64 weights, each 32 bytes: low nibbles are the chunk's first 32, high nibbles its last 32.
    sc, m = _scale_min_k4(raw[..., 4:16])  # (N, B, 8)
    qs = raw[..., 16:144].reshape(*raw.shape[:-1], 4, 32)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # (N, B, 4, 64)
    scale, minimum = d[..., None] * sc, -_half(raw, 2)[..., None] * m
    return codes.flatten(1), scale.flatten(1), minimum.flatten(1)


def check_blocks(kind: str, raw: Tensor, shape: tuple[int, int]) -> Tensor:
    """The raw bytes of an (N, K) matrix as (N, blocks, bytes), refused in one line when the format is unknown, the
    size does not match, or a block's float16 scale or minimum is not a finite number."""
    if kind not in BLOCKS:
        raise QkvError(f"GGUF tensor type {kind} has no native kernel in qkv (it runs {', '.join(BLOCKS)}); "
                       f"pass --dtype float32 to dequantise the model instead")  # fmt: skip
    per_block, size = BLOCKS[kind]
    n, k = shape
    if k % per_block or raw.numel() != n * (k // per_block) * size:
        raise QkvError(f"a {kind} tensor of shape {n} × {k} needs {n * -(-k // per_block) * size:,} bytes in blocks of "
                       f"{per_block} weights, but the file holds {raw.numel():,}: the file is damaged")  # fmt: skip
    blocks = raw.reshape(n, k // per_block, size)
    if not all(torch.isfinite(_half(blocks, at)).all() for at in HALVES[kind]):
        raise QkvError(f"a {kind} tensor of shape {n} × {k} has a block whose scale is not a finite number: "
                       f"the file is damaged")  # fmt: skip
    return blocks


def read_blocks(kind: str, raw: Tensor, shape: tuple[int, int]) -> Groups:
    """The raw bytes of an (N, K) matrix in a GGUF block format, as Groups (refused when they cannot be)."""
    codes, scale, minimum = _read(kind, check_blocks(kind, raw, shape))
    group, bits = GROUPS.get(kind, (32, 4))
    return Groups(codes.contiguous(), scale.contiguous(), minimum.contiguous(), group, bits)
