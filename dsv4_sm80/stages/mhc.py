"""The hyper-connection (mHC) stage on SM80 (seam `mhc.hc_prenorm_gemm`).

SGLang 0.5.16 mixes DSV4's hc_mult residual streams around every attention and MoE block with
`hc_pre` / `hc_post` (`srt/models/deepseek_v4.py:1383-1543`). With its defaults on CUDA
(`SGLANG_OPT_USE_TILELANG_MHC_PRE/POST=1`, `SGLANG_OPT_DEEPGEMM_HC_PRENORM=1`) `mhc_pre` runs DeepGEMM's
`tf32_hc_prenorm_gemm` (SM90 wgmma / SM100 only), then TileLang's fused sinkhorn + pre-mix (+ RMSNorm)
kernel; `hc_post` is a TileLang kernel. The model also calls `mhc_pre` at load, to prewarm its JIT
(`deepseek_v4.py:2659`), so on an A800 the DeepGEMM call would stop the server before it serves.

The TileLang kernels compile for sm_80 (`tests/kernels/test_mhc.py` builds them for sm_80 with nvcc, no GPU needed);
the DeepGEMM GEMM is replaced here by a Triton kernel on SM80's TF32 tensor cores with the same contract and
numerics class (`kernels/hc_prenorm.py`). SGLang's call sites import `tf32_hc_prenorm_gemm` from
`deep_gemm_wrapper.entrypoint` when they run, so replacing that module attribute reaches both (`mhc.py:846`
and `deepseek_v4.py:1466`). Alternatives not taken: `SGLANG_OPT_DEEPGEMM_HC_PRENORM=0` selects TileLang's
own GEMM, which 0.5.16 builds only for hc_mult x hidden in {16384, 28672} at <= 2048 tokens (DSV4-Flash is
16384, the tiny test checkpoints are not), and turning TileLang's mHC off falls back to fp32 torch ops
(another numerics class than native's TF32, and slower).
"""

from __future__ import annotations

import torch


def hc_prenorm_gemm(x: torch.Tensor, fn: torch.Tensor, out: torch.Tensor, sqrsum: torch.Tensor,
                    num_splits: int | None) -> None:
    """Replaces `deep_gemm_wrapper.entrypoint.tf32_hc_prenorm_gemm` (same arguments, fills out/sqrsum)."""
    from ..kernels.hc_prenorm import hc_prenorm

    hc_prenorm(x, fn, out, sqrsum, num_splits)
