"""Encoders into the checkpoint's native formats (used by the tiny-checkpoint generator).

- FP8 block: per 128x128 block, scale s = 2^ceil(log2(amax/448)) stored as an E8M0 byte
  (log2(s) + 127; 127 = 1.0 for an all-zero block), weight = float8_e4m3fn(W / s).
- MXFP4: per row and 32 columns, s = 2^ceil(log2(amax/6)); each value is the nearest E2M1 code
  (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign); byte = even-column code | odd << 4.
The decoders the tests use are written separately, from the format's math.
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_MAX, FP4_MAX = 448.0, 6.0


def pow2_exponent_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(ratio)) for ratio > 0 (frexp: ratio = m * 2^x, m in [0.5, 1))."""
    m, x = torch.frexp(ratio.to(torch.float64))
    return (x - (m == 0.5).to(x.dtype)).to(torch.int32)


def _exponents(amax: torch.Tensor, max_repr: float) -> torch.Tensor:
    e = torch.zeros_like(amax, dtype=torch.int32)
    nz = amax > 0
    e[nz] = pow2_exponent_ceil(amax[nz] / max_repr)
    if int(e.min()) < -127 or int(e.max()) > 127:
        raise ValueError("block scale outside the E8M0 range")
    return e


def fp8_block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w fp32 [out, in] -> (float8_e4m3fn [out, in], E8M0 bytes uint8 [ceil(out/b), ceil(in/b)])."""
    n_out, n_in = w.shape
    bo, bi = -(-n_out // block), -(-n_in // block)
    padded = torch.zeros(bo * block, bi * block, dtype=torch.float32)
    padded[:n_out, :n_in] = w
    amax = padded.view(bo, block, bi, block).abs().amax(dim=(1, 3))
    e = _exponents(amax, FP8_MAX)
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), e.to(torch.float64)).to(torch.float32)
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n_out, :n_in]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, (e + 127).to(torch.uint8)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w fp32 [out, in] -> (packed codes uint8 [out, in/2], E8M0 bytes uint8 [out, in/32])."""
    n_out, n_in = w.shape
    if n_in % 32:
        raise ValueError(f"MXFP4 needs in % 32 == 0, got {n_in}")
    groups = w.reshape(n_out, n_in // 32, 32)
    e = _exponents(groups.abs().amax(dim=2), FP4_MAX)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e.to(torch.float64)).to(torch.float32)
    x = (groups / scale.unsqueeze(-1)).reshape(n_out, n_in)
    table = torch.tensor(E2M1_MAGNITUDES)
    mag = (x.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)
    code = (mag | ((x < 0) & (mag > 0)).to(torch.int64) << 3).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, (e + 127).to(torch.uint8)
