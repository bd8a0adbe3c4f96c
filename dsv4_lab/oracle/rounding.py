"""The roundings DeepSeek-V4's own inference code applies on purpose (the model was trained with them),
as plain PyTorch functions of one tensor. Each returns a new fp32 tensor; the input is never changed.

- `fp8_e4m3_simulate`: blocks of `block` along the last dim, scale 2^ceil(log2(amax/448)) with amax clamped
  at 1e-4, values clamped to +-448 (saturating) and rounded to the nearest e4m3 value (ties to even). The
  result of the official code is kept in BF16; every value fp8 * 2^k is exact in BF16, so fp32 holds it unchanged.
- `fp4_e2m1_simulate`: blocks of 32, scale 2^ceil(log2(amax/6)) with amax clamped at 6 * 2^-126, values
  clamped to +-6 and rounded to the nearest e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6; ties to even).
- `hadamard`: the normalised Walsh-Hadamard transform (Sylvester order, scale dim^-0.5) the indexer applies
  to its query and keys before their FP4 rounding; orthogonal, so q.k is unchanged before the rounding.

The scale's ratio amax/max is taken in fp32, as the official kernels compute it, and its exponent exactly.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126


def pow2_scale(amax: torch.Tensor, max_repr: float, floor: float) -> torch.Tensor:
    """2^ceil(log2(max(amax, floor) / max_repr)), exact (frexp, not log2 in floating point)."""
    ratio = amax.float().clamp_min(floor) / max_repr
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    exp = exp - (mant == 0.5).to(exp.dtype)  # an exact power of two keeps its own exponent
    return torch.ldexp(torch.ones_like(ratio), exp)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"rounding blocks: last dim {x.shape[-1]} is not a multiple of the block {block}")
    return x.float().unflatten(-1, (-1, block))


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v (fp32, |v| <= 448) onto the e4m3 grid, nearest, ties to even (torch's own cast rounds so)."""
    return v.to(torch.float8_e4m3fn).float()


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """v (fp32, |v| <= 6) onto the e2m1 grid, nearest, ties to even. The grid's spacing is .5 below 2, 1 below
    4 and 2 up to 6, and an even multiple of the spacing is exactly an even mantissa, so round-half-even of
    v / spacing is the format's own rounding."""
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def fp8_e4m3_simulate(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(-1, keepdim=True), FP8_MAX, FP8_AMAX_FLOOR)
    q = round_e4m3((xb / scale).clamp(-FP8_MAX, FP8_MAX))
    return (q * scale).flatten(-2)


def fp4_e2m1_simulate(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(-1, keepdim=True), FP4_MAX, FP4_AMAX_FLOOR)
    q = round_e2m1((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2)


_HADAMARD: dict = {}


def hadamard(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard: last dim {n} is not a power of two")
    key = (n, x.device)
    if key not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = (h * n ** -0.5).float().to(x.device)
    return x.float() @ _HADAMARD[key]
