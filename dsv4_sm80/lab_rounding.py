"""Lab: native SGLang's FP8 roundings replayed on the SM80 datapath (DSV4_SM80_LAB_NATIVE_ROUNDING).

The H200 parity run of session 5 put the patched path 2-4x the native noise floor from native, with the dense
mode and the expert backend making no difference. What every SM80 combination shares against native is
precision, not arithmetic: native keeps the nope part of each cached key as FP8 e4m3 with a power-of-two
scale per 64 values (`kernels/ops/attention/dsv4/quant_k_cache.py:48-66`: scale = 2^ceil(log2(max(amax,
1e-8) / 448)), values clamped to +-448 and cast round-to-nearest) where the SM80 path keeps BF16. This module
replays that rounding on the BF16 rows the SM80 path stores, exactly (an e4m3 value times a power of two is
a BF16 value), so a patched run with it can be compared with native on equal terms: if the divergence then
falls to the floor, the rest of the datapath is shown equal and the gap is the precision choice alone.

Lab only: never a default, never for serving. Not replayed (yet): native's FP8 activations in its block
linears and its FP8 indexer keys and queries.
"""

from __future__ import annotations

import sys

import torch

from . import env

NOPE = 448  # of the 512-wide key row; the last 64 (rope) stay BF16 in native too
TILE = 64
FP8_MAX = 448.0
EPS = 1e-8
_told = False


def fp8_pow2_tiles(x: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """x [..., D] (D a multiple of tile) through native's key quantization and back, in x's dtype."""
    xf = x.float().unflatten(-1, (-1, tile))
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(EPS)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2).to(x.dtype)


def kv_rows_(cache_rows: torch.Tensor, loc: torch.Tensor) -> None:
    """The rows at loc (>= 0) of a [slots, 512] BF16 key cache, their nope part rounded as native stores it."""
    if cache_rows.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("DSV4_SM80_LAB_NATIVE_ROUNDING is for eager runs: disable CUDA graphs for this experiment")
    loc = loc.reshape(-1).long()
    loc = loc[loc >= 0]
    if loc.numel() == 0:
        return
    rows = cache_rows.index_select(0, loc)
    rows[:, :NOPE] = fp8_pow2_tiles(rows[:, :NOPE])
    cache_rows.index_copy_(0, loc, rows)


def kv_enabled() -> bool:
    global _told
    on = env.get(env.LAB_NATIVE_ROUNDING) == "kv"
    if on and not _told:
        _told = True
        print("dsv4-sm80 LAB: DSV4_SM80_LAB_NATIVE_ROUNDING=kv, key rows rounded to native's FP8 grid "
              "(parity experiment; not a serving configuration)", file=sys.stderr, flush=True)
    return on
