"""W4A8 fused MoE for SM80: MXFP4 experts stay 4-bit in memory, the GEMMs run on INT8 (tensor cores, or DP4A on CUDA
cores for the smallest batches). This file is the host side: checks, the kernel a call runs (the table in
`w4a8_moe_table.py`, by the number of (token, expert) pairs), the alignment by expert, and the launch sequence.

Why Triton: the kernels must run at tiny sizes on the CPU (TRITON_INTERPRET=1) for CI, be capture-safe for CUDA
graphs, and compile for sm_80 without touching SGLang's build; `tl.dot` on int8 operands lowers to
`mma.sync ... s8.s8.s32` on SM80.

The files, each beside the plain-PyTorch reference `w4a8_moe_ref.py` the tests hold them to:
- `w4a8_moe_layout.py`: the repacked 4-bit layout, the shift maps, the PTX code decoders;
- `w4a8_moe_io.py`: the input's INT8 rounding, the GLU epilogue, split-K's finish, the top-k combine;
- `w4a8_moe_wide.py` (1 token), `w4a8_moe_gemv.py` (2-32), `w4a8_moe_mma.py` (33-8,192),
  `w4a8_moe_expand.py` (above 8,192 with every column shiftable): the kernel families;
- `w4a8_moe_table.py`: which family and tile for which batch, with the reason and the figure for each.

Every family computes sum_k w_k * down_e(act(gate_up_e(x))) * scaling with the weight side exact (each 32-deep INT8
dot exact in int32, scaled by its power of two): only the activations' INT8 rounding is lossy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .w4a8_moe_expand import (  # noqa: F401  # noqa: F401  (bench/sass_census.py compiles them)
    EXPAND_TOKENS,
    Expand,
    _expand_kernel,
    _w8_moe_kernel,
    expand_experts,
    expand_moe,
    expand_share,
)
from .w4a8_moe_gemv import Gemv, _w4a8_gemv_kernel, gemv_moe  # noqa: F401
from .w4a8_moe_io import quantize_rows_int8, sum_pairs
from .w4a8_moe_layout import CHUNK, INTERPRETED, decode_asm, repack_mxfp4_for_w4a8, shift_refs  # noqa: F401
from .w4a8_moe_mma import Mma, _w4a8_moe_kernel, mma_moe  # noqa: F401
from .w4a8_moe_table import TABLE, Row, select  # noqa: F401
from .w4a8_moe_wide import Wide, wide_moe


class Experts(NamedTuple):
    """One layer's experts as the kernels read them: the repacked codes and E8M0 scale bytes (uint8 views) and the
    shift maps (uint8 [E, 2I] and [E, H], or None)."""
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_eref: torch.Tensor | None
    w2_eref: torch.Tensor | None


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, k) pairs by expert and pad each expert's run to a multiple of block_m.

    Returns sorted_ids [P + E*(block_m-1)] (pair index, or P for padding), block_expert [blocks]
    (-1 past the end), num_padded [1] (device). No host sync: capture-safe."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    pos = starts[sorted_expert] + torch.arange(pairs, device=dev) - first_of_expert[sorted_expert]
    cap = pairs + num_experts * (block_m - 1)
    sorted_ids = torch.full((cap,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    blocks = (cap + block_m - 1) // block_m
    block_start = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    if cap % block_m:
        sorted_ids = torch.cat([sorted_ids, sorted_ids.new_full((blocks * block_m - cap,), pairs)])
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`align_by_expert`, or on a GPU SGLang's own moe_align_block_size (one kernel instead of ~15
    small ones; the same contract: padding ids = number of pairs, blocks past the end never read)."""
    if topk_ids.is_cuda and not INTERPRETED:
        try:
            from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import moe_align_block_size
        except ImportError:
            moe_align_block_size = None
        if moe_align_block_size is not None:
            return moe_align_block_size(topk_ids, block_m, num_experts)
    return align_by_expert(topk_ids, num_experts, block_m)


def choose(pairs: int, h: int, inter: int, expand_ok: bool) -> Wide | Gemv | Mma | Expand:
    """The table's kernel for a call (gemv's K shares lowered to what the hidden size divides)."""
    kernel = select(pairs, inter, expand_ok).kernel
    return kernel.for_hidden(h) if isinstance(kernel, Gemv) else kernel


def w4a8_moe(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, swiglu_limit: float = 10.0,
    routed_scaling_factor: float = 1.0, out: torch.Tensor | None = None, w13_eref: torch.Tensor | None = None,
    w2_eref: torch.Tensor | None = None, expand_ok: bool = False, kernel: Wide | Gemv | Mma | Expand | None = None,
) -> torch.Tensor:
    """The routed-expert output for x [T, H] (bf16): sum_k w_k * down_e(act(gate_up_e(x))) * scaling.

    w13 [E, 2I, H/2] and w2 [E, H, I/2]: MXFP4 bytes in the kernel layout (`repack_mxfp4_for_w4a8`); scales
    [E, 2I, H/32], [E, H, I/32]: E8M0 (float8_e8m0fnu or uint8). topk_* [T, top_k]. w13_eref [E, 2I], w2_eref
    [E, H]: the shift maps of those scales (`shift_refs`, computed once at load); expand_ok: the caller's word that
    every column of both maps is shiftable (the expanded row needs it). kernel: the table's choice by default; a
    family's configuration to run that one instead (the benchmark's alternatives, the tests)."""
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    pairs = t * top_k
    if h % CHUNK or inter % CHUNK:
        raise ValueError(f"w4a8_moe: hidden {h} and intermediate {inter} must be multiples of {CHUNK} (the 64-wide "
                         "K chunks of the repacked layout); pad the layer")
    for name, w in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if not w.is_contiguous():  # the kernels address the repacked tiles and scale pairs by shape alone
            raise ValueError(f"{name} must be contiguous (shape {tuple(w.shape)}, strides {tuple(w.stride())}): "
                             "the kernel layout is addressed from its shape")
    maps = []
    for name, m, shape in (("w13_eref", w13_eref, (e, two_i)), ("w2_eref", w2_eref, (e, h))):
        if m is not None and tuple(m.shape) != shape:
            raise ValueError(f"w4a8_moe: {name} has shape {tuple(m.shape)}, expected {shape}: pass shift_refs of "
                             f"{name[:-5]}_scale")
        maps.append(None if m is None else m.view(torch.uint8).contiguous())
    w = Experts(w13.view(torch.uint8), w13_scale.view(torch.uint8), w2.view(torch.uint8), w2_scale.view(torch.uint8),
                *maps)
    have_maps = w.w13_eref is not None and w.w2_eref is not None
    cfg = kernel if kernel is not None else choose(pairs, h, inter, expand_ok and have_maps)
    cfg.check(h, inter)
    if isinstance(cfg, Expand) and not have_maps:
        raise ValueError(f"w4a8_moe {cfg} needs both shift maps given (w13_eref, w2_eref)")
    asm = decode_asm(x)
    res = out if out is not None and out.is_contiguous() else torch.empty((t, h), dtype=x.dtype, device=x.device)
    if isinstance(cfg, Wide):
        wide_moe(cfg, x, w, topk_weights, topk_ids, res, swiglu_limit, routed_scaling_factor, asm)
    else:
        xq, xs = quantize_rows_int8(x)
        hq = torch.empty((pairs, inter), dtype=torch.int8, device=x.device)
        hs = torch.empty((pairs, inter // cfg.group), dtype=torch.float32, device=x.device)
        tile = cfg.tile if isinstance(cfg, Expand) else cfg
        # per-pair outputs in BF16 before the fp32 top-k sum, as SGLang's Marlin MoE keeps its intermediate cache
        bf16 = isinstance(tile, Mma) and tile.pair_bf16
        y = torch.empty((pairs, h), dtype=torch.bfloat16 if bf16 else torch.float32, device=x.device)
        tw = topk_weights.reshape(-1).to(torch.float32)
        if isinstance(cfg, Gemv):
            gemv_moe(cfg, xq, xs, w, topk_ids.reshape(-1).contiguous(), tw, hq, hs, y, top_k, swiglu_limit, asm)
        elif isinstance(cfg, Mma):
            mma_moe(cfg, xq, xs, w, _align(topk_ids, e, cfg.block_m), tw, hq, hs, y, top_k, swiglu_limit, asm)
        else:
            expand_moe(cfg, xq, xs, w, _align(topk_ids, e, cfg.tile.block_m), tw, hq, hs, y, top_k, swiglu_limit,
                       asm)
        sum_pairs(y, res, top_k, routed_scaling_factor)
    return res if out is None or res is out else out.copy_(res)
