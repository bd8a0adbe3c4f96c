"""The W4A8 MoE on CUDA cores for small decode batches (the table runs it from 2 to 32 tokens): program (pair, column
tile, K share) multiplies its pair's one row, no sorting by expert. Each code is decoded once (the PRMT decoder, a
word in, each group's four INT8 values out) and multiplied once (DP4A, four INT8 products per instruction), one column
per thread so every sum over words stays in its thread. An MMA tile would carry 15 padding rows for the one real
row, every group's conversion and scaling done on all 16.

The same exact int32 group dots and the same fp32 steps in the same order as the MMA kernel's per-group loop
(`w4a8_moe_io._add_groups`): bit-equal to it in the interpreter. Triton does not pipeline a loop without `tl.dot`,
and ptxas issues a step's loads next to the DP4As that use them, so the loop issues every load of the next K step in
this one, carried in registers.

Gate-up: K in `split_k` shares, each its own program writing fp32 (gate, up) partials that `glu_finish` adds in a
fixed order (deterministic) before the GLU epilogue; with one share the epilogue runs in the gate-up program.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .w4a8_moe_io import _add_groups, _glu_quant, glu_finish
from .w4a8_moe_layout import CHUNK, GROUP, _col_base, _pair_tile, _scale_word, _word_products, _word_scales


@dataclass(frozen=True)
class Gemv:
    """`_w4a8_gemv_kernel`'s configuration: gate-up K in `split_k` shares of `n` columns a program (with one share
    the program takes `group` columns, the intermediate's INT8 group, and runs the GLU itself), down programs of
    `n2` output columns; warps = columns / 32."""
    split_k: int = 8
    n: int = 128
    n2: int = 128
    group: int = 32

    def for_hidden(self, h: int) -> Gemv:
        """The largest share count up to split_k whose shares are whole 64-deep K steps of hidden h."""
        split_k = self.split_k
        while split_k > 1 and h % (split_k * CHUNK):
            split_k //= 2
        return replace(self, split_k=split_k)

    def check(self, h: int, inter: int) -> None:
        if self.split_k < 1 or h % (self.split_k * CHUNK) or self.group % GROUP or inter % self.group \
                or self.n % 32 or self.n2 % 32:
            raise ValueError(f"w4a8_moe {self}: hidden {h} must be a multiple of {CHUNK} x split_k, the intermediate "
                             f"{inter} of group (a multiple of {GROUP}), and n, n2 multiples of 32")


@triton.jit
def _gemv_column_loads(wbase, s_ptrs, k0, ok):
    """One K step's codes of BLOCK_N columns as (first half, second half) [4, BLOCK_N] int32 and their scale word."""
    w_ptrs = wbase[None, :] + (k0 * 4 + tl.arange(0, 4))[:, None]
    return (tl.load(w_ptrs, mask=ok[None, :], other=0), tl.load(w_ptrs + 4, mask=ok[None, :], other=0),
            _scale_word(s_ptrs + k0 // 32, ok))


@triton.jit
def _gemv_loads(x_words, a_scale_row_ptr, s_ptrs, wbase, wbase_up, up_s, k0, n_ok, k_hi, GATED: tl.constexpr,
                A_GROUP: tl.constexpr):
    """Every load of the 64-deep K step at k0 of one row against BLOCK_N columns, as a tuple: the row's INT8
    activation words (x_words: int32 pointer; words k0/4 .. +3, +8, +4, +12, in the order the dots take them), its
    activation scales when per group (else 0.0), and the gate's and (GATED) the up rows' codes and scale word: wbase
    [BLOCK_N] int32 pointers to each column's first K chunk, whose 8 words per step are read as two 4-word halves.
    A step at or past k_hi (the loop's look-ahead past its share) and columns past n_ok read as 0."""
    xa = x_words + k0 // 4 + tl.arange(0, 4)
    live = k0 < k_hi
    ok = n_ok & live
    xs = (tl.load(xa, mask=live, other=0), tl.load(xa + 8, mask=live, other=0),
          tl.load(xa + 4, mask=live, other=0), tl.load(xa + 12, mask=live, other=0))
    sa0 = 0.0  # (per-row activation scale: applied after the loop)
    sa1 = 0.0
    if A_GROUP:  # activation scale per group of A_GROUP columns of K
        sa0 = tl.load(a_scale_row_ptr + k0 // A_GROUP, mask=live, other=0.0)
        sa1 = tl.load(a_scale_row_ptr + (k0 + 32) // A_GROUP, mask=live, other=0.0)
    gate = _gemv_column_loads(wbase, s_ptrs, k0, ok)
    up = gate
    if GATED:  # the up rows of the same columns sit N rows further
        up = _gemv_column_loads(wbase_up, s_ptrs + up_s, k0, ok)
    return xs, sa0, sa1, gate, up


@triton.jit
def _gemv_dots_step(acc, xs, sa0, sa1, w, A_GROUP: tl.constexpr, DECODE_ASM: tl.constexpr):
    """acc plus one K step from its loads (w: a (first half, second half, scale word) of the gate or the up rows):
    the two scale groups' exact int32 dots, scaled in `_add_groups`' order."""
    a0, a1 = _word_products(w[0], xs[0][:, None], xs[1][:, None], DECODE_ASM)
    b0, b1 = _word_products(w[1], xs[2][:, None], xs[3][:, None], DECODE_ASM)
    s0, s1 = _word_scales(w[2])
    d0 = (tl.sum(a0, axis=0) + tl.sum(b0, axis=0)).to(tl.float32)
    d1 = (tl.sum(a1, axis=0) + tl.sum(b1, axis=0)).to(tl.float32)
    return _add_groups(acc, d0, d1, s0, s1, sa0, sa1, A_GROUP, False)


@triton.jit
def _gemv_loop(a_row_ptr, a_scale_row_ptr, b_base, bs_base, offs_n, n_ok, N, k_lo, k_hi, stride_bn,
               stride_bsn, GATED: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
               DECODE_ASM: tl.constexpr):
    """K in [k_lo, k_hi) for one row, each step's loads issued one step ahead (at one token the plain loop's warps
    waited on each step's loads in turn: H200 profile, 4.5-5.3 cycles of long-scoreboard stall per issued
    instruction). Returns fp32 (gate, up)."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_words = a_row_ptr.to(tl.pointer_type(tl.int32))
    wbase = (b_base + _col_base(offs_n, stride_bn)).to(tl.pointer_type(tl.int32))
    wbase_up = (b_base + N * stride_bn + _col_base(offs_n, stride_bn)).to(tl.pointer_type(tl.int32))
    s_ptrs = bs_base + offs_n * stride_bsn
    up_s = N * stride_bsn
    cur = _gemv_loads(x_words, a_scale_row_ptr, s_ptrs, wbase, wbase_up, up_s, k_lo, n_ok, k_hi, GATED, A_GROUP)
    for k0 in range(k_lo, k_hi, 64):
        ahead = _gemv_loads(x_words, a_scale_row_ptr, s_ptrs, wbase, wbase_up, up_s, k0 + 64, n_ok, k_hi, GATED,
                            A_GROUP)
        xs, sa0, sa1, gate, up = cur
        acc = _gemv_dots_step(acc, xs, sa0, sa1, gate, A_GROUP, DECODE_ASM)
        if GATED:
            acc_up = _gemv_dots_step(acc_up, xs, sa0, sa1, up, A_GROUP, DECODE_ASM)
        cur = ahead
    return acc, acc_up


@triton.jit
def _w4a8_gemv_kernel(
    a_ptr, a_scale_ptr, b_ptr, bs_ptr, c_ptr, c_scale_ptr, expert_ptr, topk_w_ptr,
    N, K, num_pairs, a_row_div, a_scale_groups, limit,
    stride_am, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, c_scale_groups,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE_ASM: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
):
    """Program (pair p, column tile[, K share]): expert_ptr is the flattened topk_ids [pairs] (< 0: nothing to do),
    the row is p // a_row_div. Outputs as the MMA kernel's epilogues: split-K partials [SPLIT_K, pairs, 2, N], or
    the GLU and the intermediate's INT8 rounding per BLOCK_N columns, or (down) the pair row times its router
    weight."""
    p, pid_n, expert, row, offs_n = _pair_tile(expert_ptr, N, a_row_div, BLOCK_N)
    if expert < 0:
        return
    n_ok = offs_n < N
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_share = tl.cdiv(K, SPLIT_K * 64) * 64
        k_lo = tl.program_id(1) * k_share
        k_hi = tl.minimum(k_lo + k_share, K)
    acc, acc_up = _gemv_loop(a_ptr + row * stride_am, a_scale_ptr + row * a_scale_groups,
                             b_ptr + expert * stride_be, bs_ptr + expert * stride_bse, offs_n, n_ok, N,
                             k_lo, k_hi, stride_bn, stride_bsn, GATED, A_GROUP, BLOCK_N, DECODE_ASM)
    if not A_GROUP:  # one activation scale per row
        sa = tl.load(a_scale_ptr + row)
        acc = acc * sa
        acc_up = acc_up * sa
    acc = acc * 0.5  # the codes were twice the E2M1 values
    out = p.to(tl.int64)
    if GATED and SPLIT_K > 1:  # this share's partial sums; _glu_finish_kernel adds the shares
        part = c_ptr + (tl.program_id(1).to(tl.int64) * num_pairs + out) * (2 * N) + offs_n
        tl.store(part, acc, mask=n_ok)
        tl.store(part + N, acc_up, mask=n_ok)
    elif GATED:
        q, s = _glu_quant(acc[None, :], acc_up[None, :], n_ok, limit, False)
        tl.store(c_ptr + out * stride_cm + offs_n[None, :], q, mask=n_ok[None, :])
        tl.store(c_scale_ptr + out * c_scale_groups + pid_n + tl.arange(0, 1), s)
    else:
        if MUL_WEIGHT:
            acc = acc * tl.load(topk_w_ptr + out)
        tl.store(c_ptr + out * stride_cm + offs_n, acc.to(c_ptr.dtype.element_ty), mask=n_ok)


def gemv_moe(cfg: Gemv, xq, xs, w, ids, topk_w, hq, hs, y, top_k: int, limit: float, decode_asm: bool) -> None:
    """Gate-up (and split-K's finish) then down for every (token, expert) pair, ids the flattened topk_ids: the INT8
    input xq [T, H] -> the intermediate hq [pairs, I] (scales hs, per cfg.group columns) -> the per-pair outputs
    y [pairs, H] times their router weights. w: `w4a8_moe.Experts`."""
    pairs, inter = hq.shape
    h = y.shape[1]
    if not pairs:
        return
    split = cfg.split_k > 1
    gn = cfg.n if split else cfg.group  # split-K partials free the gate-up tile from the intermediate's group
    part = torch.empty((cfg.split_k, pairs, 2, inter), dtype=torch.float32, device=hq.device) if split else hq
    _w4a8_gemv_kernel[(pairs * triton.cdiv(inter, gn), cfg.split_k)](
        a_ptr=xq, a_scale_ptr=xs, b_ptr=w.w13, bs_ptr=w.w13_scale, c_ptr=part, c_scale_ptr=hs, expert_ptr=ids,
        topk_w_ptr=topk_w, N=inter, K=h, num_pairs=pairs, a_row_div=top_k, a_scale_groups=xs.shape[1],
        limit=float(limit), stride_am=xq.stride(0), stride_be=w.w13.stride(0), stride_bn=w.w13.stride(1),
        stride_bse=w.w13_scale.stride(0), stride_bsn=w.w13_scale.stride(1), stride_cm=hq.stride(0),
        c_scale_groups=hs.shape[1], GATED=True, MUL_WEIGHT=False, A_GROUP=0, BLOCK_N=gn, DECODE_ASM=decode_asm,
        SPLIT_K=cfg.split_k, num_warps=max(1, gn // 32))
    if split:
        glu_finish(part, hq, hs, limit, cfg.group)
    _w4a8_gemv_kernel[(pairs * triton.cdiv(h, cfg.n2),)](
        a_ptr=hq, a_scale_ptr=hs, b_ptr=w.w2, bs_ptr=w.w2_scale, c_ptr=y, c_scale_ptr=y, expert_ptr=ids,
        topk_w_ptr=topk_w, N=h, K=inter, num_pairs=pairs, a_row_div=1, a_scale_groups=hs.shape[1], limit=0.0,
        stride_am=hq.stride(0), stride_be=w.w2.stride(0), stride_bn=w.w2.stride(1), stride_bse=w.w2_scale.stride(0),
        stride_bsn=w.w2_scale.stride(1), stride_cm=y.stride(0), c_scale_groups=0, GATED=False, MUL_WEIGHT=True,
        A_GROUP=cfg.group, BLOCK_N=cfg.n2, DECODE_ASM=decode_asm, num_warps=max(1, cfg.n2 // 32))
