"""Plain-PyTorch reference for the hyper-connection pre-norm GEMM (`hc_prenorm.py`), written from the
contract of DeepGEMM's `tf32_hc_prenorm_gemm` as SGLang 0.5.16 calls it (`kernels/ops/layernorm/mhc.py:836-856`,
`srt/models/deepseek_v4.py:1465-1481`):

    a [m, k] BF16 (the residual streams, hc_mult x hidden flattened), b [n, k] fp32 (hc_fn, n = 2 hc + hc^2)
    d[s, i, j]  = sum over split s's k of a[i, k] * tf32(b[j, k])
    sq[s, i]    = sum over split s's k of a[i, k]^2
    (num_splits None: d [m, n], sq [m], one split)

The consumer (TileLang `mhc_pre_big_fuse*`) adds the splits, so only their sum is defined; how K is cut
between splits is the kernel's business. tf32(x): x rounded to the nearest TF32 value, ties away from zero
(`cvt.rna.tf32.f32`). DeepGEMM feeds hc_fn to wgmma .tf32 straight from fp32 shared memory; on the H200 its
result matches this rounding, not truncation (the 13 low bits cleared): dsv4_lab/beds/mhc_check.py
found DeepGEMM 1.1-3.2e-5 (relative to sum |a||b|) from a truncating kernel, where the CPU model of
truncation against rounding gives 1.5-3.0e-5 at the same shapes (truncation against exact fp32: 1.5-2.4e-5).
BF16 inputs are exact in TF32.
"""

from __future__ import annotations

import torch


def tf32_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp32 holding a TF32 value: rounded to nearest at the 13th mantissa bit, ties away from zero
    (a carry into the exponent is the correct rounding; inf stays inf; NaN stays NaN, where the integer add
    alone could wrap a NaN's bits round to a zero)."""
    x = x.to(torch.float32).contiguous()
    rounded = ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded)


def tf32_truncate(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp32 with the low 13 mantissa bits cleared: a truncating kernel's model (kept to show
    the tests can tell the two roundings apart)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32)


def hc_prenorm_ref(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d [m, n], sq [m]) in float64: all splits summed."""
    a64 = a.to(torch.float64)
    d = a64 @ tf32_round(b).to(torch.float64).t()
    return d, a64.pow(2).sum(-1)
