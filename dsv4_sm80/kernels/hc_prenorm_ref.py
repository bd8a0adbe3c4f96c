"""Plain-PyTorch reference for the hyper-connection pre-norm GEMM (`hc_prenorm.py`), written from the
contract of DeepGEMM's `tf32_hc_prenorm_gemm` as SGLang 0.5.16 calls it (`kernels/ops/layernorm/mhc.py:836-856`,
`srt/models/deepseek_v4.py:1465-1481`):

    a [m, k] BF16 (the residual streams, hc_mult x hidden flattened), b [n, k] fp32 (hc_fn, n = 2 hc + hc^2)
    d[s, i, j]  = sum over split s's k of a[i, k] * tf32(b[j, k])
    sq[s, i]    = sum over split s's k of a[i, k]^2
    (num_splits None: d [m, n], sq [m], one split)

The consumer (TileLang `mhc_pre_big_fuse*`) adds the splits, so only their sum is defined; how K is cut
between splits is the kernel's business. tf32(x): the fp32 value with its 13 low mantissa bits cleared —
what a TF32 tensor-core instruction reads from an fp32 operand (DeepGEMM feeds hc_fn to wgmma .tf32 straight
from fp32 shared memory). BF16 inputs are exact in TF32.
"""

from __future__ import annotations

import torch


def tf32_truncate(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp32 holding a TF32 value: the low 13 mantissa bits cleared (sign and exponent kept)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32)


def hc_prenorm_ref(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d [m, n], sq [m]) in float64: all splits summed."""
    a64 = a.to(torch.float64)
    d = a64 @ tf32_truncate(b).to(torch.float64).t()
    return d, a64.pow(2).sum(-1)
