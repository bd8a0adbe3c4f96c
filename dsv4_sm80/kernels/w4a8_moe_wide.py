"""The W4A8 MoE for one token (the table runs it up to 6 pairs): two launches in which every load of a program is
issued at once, no alignment, quantizer, split-K finish or top-k launch.

At one token the MMA tile is issue-bound on its 15 padding rows and gemv's few warps wait on each K step's loads in
turn; both moved their 12.6 + 6.3 MB (TP4 shapes) at 1.0-1.3 TB/s, and three small launches came on top. Here:
- gate-up: program (pair, n columns) first rounds its token's BF16 row to INT8 itself (`w4a8_moe_io`'s quantizer
  operations, into a scratch row read back after a barrier), then loads the gate's and the up rows' codes over the
  whole K as [K/64, n, 8]-word tensors (in the tile-major layout each chunk's n columns are one contiguous block),
  reduces K across the program's threads, and runs the GLU and the intermediate's INT8 rounding per n columns;
- down: program (token, n2 output columns) loads the down rows of all of the token's pairs at once, times each
  pair's router weight, sums them in pair order and applies the routed scaling.
The same exact int32 group dots as every other loop (PRMT decode, DP4A); the fp32 sums run in another order (a tree
over K), so outputs agree with the other kernels to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import round_int8
from .w4a8_moe_io import _glu_quant, _int8_scale
from .w4a8_moe_layout import CHUNK, _pair_tile, _scale_word, _word_products, _word_scales


@dataclass(frozen=True)
class Wide:
    """Gate-up programs of n columns with `warps` warps (n is also the intermediate's INT8 group), down programs of
    n2 output columns with `warps2`."""
    n: int = 32
    warps: int = 16
    n2: int = 16
    warps2: int = 8

    @property
    def group(self) -> int:
        return self.n

    def check(self, h: int, inter: int) -> None:
        if self.n % 32 or inter % self.n:
            raise ValueError(f"w4a8_moe {self}: n={self.n} must be a multiple of 32 that divides the intermediate "
                             f"{inter}")
        if not (self.n2 == 16 or self.n2 % 32 == 0) or h % self.n2:
            raise ValueError(f"w4a8_moe {self}: n2={self.n2} must be 16 or a multiple of 32 that divides hidden {h}")


@triton.jit
def _wide_codes(w_rows, offs_n, K: tl.constexpr):
    """The codes of R chunk rows against BLOCK_N columns offs_n (16, or a multiple of 32, aligned to itself), as one
    [R, BLOCK_N, 8]-word tensor: w_rows [R] int32 pointers to each row's 64-deep K chunk block. Unmasked: a row that
    must add nothing (padding past K, a missing pair) points at valid codes and its scales read as 0 (`_wide_rows`);
    a masked load took a zeroing instruction per register in the sm_80 build."""
    offs_w = tl.arange(0, 8)
    col = (offs_n // 32) * (K * 4) + (offs_n % 32) * 8  # in words: a 32-row tile is 32 * K/2 bytes
    return tl.load(w_rows[:, None, None] + col[None, :, None] + offs_w[None, None, :])


@triton.jit
def _wide_x(x_rows, offs_n):
    """The INT8 activation words the codes of `_wide_codes` multiply, in their shape and layout: x_rows [R] int32
    pointers to the activation row's words at each row's chunk; word q of a chunk pairs with x words q (the first
    scale group) and 8 + q (the second). Addressed per element like the codes so that they share the codes' layout
    (loaded as [R, 1, 8] and broadcast, Triton moved the decoded codes to another layout through shared memory)."""
    xw = x_rows[:, None, None] + tl.arange(0, 8)[None, None, :] + 0 * offs_n[None, :, None]
    return tl.load(xw), tl.load(xw + 8)


@triton.jit
def _wide_rows(words, x_lo, x_hi, s_rows, sa_rows, k_rows, ok, offs_n, stride_bsn, A_GROUP: tl.constexpr,
               DECODE_ASM: tl.constexpr):
    """R chunk rows against BLOCK_N columns: fp32 [R, BLOCK_N], per row its two scale groups' exact int32 dots times
    their weight scales (s_rows [R]: each row's scale bytes, column n's pair n * stride_bsn further) and, A_GROUP (a
    multiple of 32), their activation scales (sa_rows [R] fp32 pointers to the activation row's scales, k_rows [R]
    the chunk's K offset); the per-row scale of A_GROUP 0 is the caller's. Rows where ok [R] is false read their
    scales as 0 and add exactly 0."""
    ok2 = ok[:, None]
    s0, s1 = _word_scales(_scale_word(s_rows[:, None] + offs_n[None, :] * stride_bsn, ok2))
    p_lo, p_hi = _word_products(words, x_lo, x_hi, DECODE_ASM)
    if A_GROUP:
        sa_lo = tl.load(sa_rows[:, None] + k_rows[:, None] // A_GROUP, mask=ok2, other=0.0)
        sa_hi = tl.load(sa_rows[:, None] + (k_rows[:, None] + 32) // A_GROUP, mask=ok2, other=0.0)
        v = (tl.sum(p_lo, axis=2).to(tl.float32) * s0) * sa_lo + (tl.sum(p_hi, axis=2).to(tl.float32) * s1) * sa_hi
    else:
        v = tl.sum(p_lo, axis=2).to(tl.float32) * s0 + tl.sum(p_hi, axis=2).to(tl.float32) * s1
    return v


@triton.jit
def _wide_gate_up_kernel(
    x_ptr, b_ptr, bs_ptr, q_ptr, q_scale_ptr, expert_ptr, xq_ptr,
    N, a_row_div, limit, stride_xm, stride_be, stride_bse, stride_bsn, stride_qm, q_groups,
    K: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, DECODE_ASM: tl.constexpr,
):
    """Program (pair, BLOCK_N columns): the token's row x (BF16) rounded to INT8 into this program's scratch row
    xq_ptr + pid * 64C (the rounding before the code loads: after them the row held the codes' registers longer,
    11.4 us at one token on the H200 against 8.4 for the plain launch and 2.1 for a quantizer launch), then the gate
    and the up rows over the pair's whole K (C: K/64 rounded up to a power of two; chunks past K/64 read the last
    chunk's memory and add 0), the clamped SiLU-GLU and the intermediate's INT8 rounding per BLOCK_N columns. N (the
    intermediate) a multiple of BLOCK_N, K (hidden) of 64."""
    p, pid_n, expert, row, offs_n = _pair_tile(expert_ptr, N, a_row_div, BLOCK_N)
    if expert < 0:
        return
    offs_c = tl.arange(0, C)
    ok = offs_c < K // 64
    c_at = tl.minimum(offs_c, K // 64 - 1)  # (padded chunks read the last one's memory; their scales read as 0)
    w_rows = (b_ptr + expert * stride_be).to(tl.pointer_type(tl.int32)) + c_at * 256
    s_rows = bs_ptr + expert * stride_bse + 2 * offs_c
    offs_k = tl.arange(0, 64 * C)
    xv = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    sa = _int8_scale(tl.max(tl.abs(xv), axis=0))
    scratch = xq_ptr + tl.program_id(0).to(tl.int64) * (64 * C)
    tl.store(scratch + offs_k, round_int8(tl.math.div_rn(xv, sa)))
    tl.debug_barrier()  # each thread reads words the others wrote
    x_words = scratch.to(tl.pointer_type(tl.int32))
    gate_w = _wide_codes(w_rows, offs_n, K)
    up_w = _wide_codes(w_rows + N * (K // 8), offs_n, K)  # the up rows sit N rows further
    x_lo, x_hi = _wide_x(x_words + 16 * c_at, offs_n)
    gate = tl.sum(_wide_rows(gate_w, x_lo, x_hi, s_rows, s_rows, 64 * offs_c, ok, offs_n, stride_bsn, 0,
                             DECODE_ASM), axis=0) * sa
    up = tl.sum(_wide_rows(up_w, x_lo, x_hi, s_rows + N * stride_bsn, s_rows, 64 * offs_c, ok, offs_n, stride_bsn,
                           0, DECODE_ASM), axis=0) * sa
    q, s = _glu_quant((gate * 0.5)[None, :], up[None, :], offs_n < N, limit, False)
    tl.store(q_ptr + p.to(tl.int64) * stride_qm + offs_n[None, :], q)
    tl.store(q_scale_ptr + p.to(tl.int64) * q_groups + pid_n + tl.arange(0, 1), s)


@triton.jit
def _wide_down_kernel(
    h_ptr, h_scale_ptr, b_ptr, bs_ptr, out_ptr, expert_ptr, topk_w_ptr,
    N, h_groups, scale, stride_hm, stride_be, stride_bse, stride_bsn, stride_om,
    K: tl.constexpr, C: tl.constexpr, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr, A_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, DECODE_ASM: tl.constexpr,
):
    """Program (token, BLOCK_N output columns): the down rows of all the token's TOP_K pairs over the intermediate K
    at once (TOP_K_P x C chunk rows: pair j = row // C, chunk c = row % C; TOP_K_P and C powers of two; rows past
    TOP_K pairs or K/64 chunks, or of expert -1, read valid memory and add 0: their scales and weights read 0), each
    row times 1/2 (the codes are twice the E2M1 values) and its pair's router weight, summed, times the routed
    scaling, cast to out's dtype. N (hidden) a multiple of BLOCK_N. (A loop over the pairs waited on each pair's
    expert id and codes in turn: 10.0 us at one token on the H200 against 5.9 for all pairs at once.)"""
    pid = tl.program_id(0)
    n_tiles = N // BLOCK_N
    t = pid // n_tiles
    offs_n = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, TOP_K_P * C)
    j = r // C
    c = r % C
    pair = t.to(tl.int64) * TOP_K + j
    expert = tl.load(expert_ptr + pair, mask=j < TOP_K, other=-1).to(tl.int64)
    ok = (j < TOP_K) & (expert >= 0) & (c < K // 64)
    # rows that add nothing read valid memory (expert 0, the token's first pair, the last chunk); their scales read 0
    expert = tl.maximum(expert, 0)
    pair_at = tl.where(j < TOP_K, pair, t.to(tl.int64) * TOP_K)
    c_at = tl.minimum(c, K // 64 - 1)
    w_rows = (b_ptr + expert * stride_be).to(tl.pointer_type(tl.int32)) + c_at * 256
    s_rows = bs_ptr + expert * stride_bse + 2 * c
    x_rows = (h_ptr + pair_at * stride_hm).to(tl.pointer_type(tl.int32)) + 16 * c_at
    words = _wide_codes(w_rows, offs_n, K)
    x_lo, x_hi = _wide_x(x_rows, offs_n)
    v = _wide_rows(words, x_lo, x_hi, s_rows, h_scale_ptr + pair_at * h_groups, 64 * c, ok, offs_n, stride_bsn,
                   A_GROUP, DECODE_ASM)
    weight = tl.load(topk_w_ptr + pair, mask=ok, other=0.0) * 0.5
    total = tl.sum(v * weight[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, (total * scale).to(out_ptr.dtype.element_ty))


def wide_moe(cfg: Wide, x, w, topk_weights, topk_ids, res, limit: float, scaling: float, decode_asm: bool) -> None:
    """The routed-expert output of x [T, H] (BF16) into res [T, H] (contiguous) in two launches.
    w: `w4a8_moe.Experts`."""
    t, h = x.shape
    if not t:
        return
    inter = w.w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    pairs = t * top_k
    dev = x.device
    c_up = triton.next_power_of_2(h // CHUNK)
    groups = inter // cfg.n  # the intermediate's INT8 groups a pair, one per gate-up program
    hq = torch.empty((pairs, inter), dtype=torch.int8, device=dev)
    hs = torch.empty((pairs, groups), dtype=torch.float32, device=dev)
    scratch = torch.empty((pairs * groups, 64 * c_up), dtype=torch.int8, device=dev)  # a row per program
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    _wide_gate_up_kernel[(pairs * groups,)](
        x_ptr=x, b_ptr=w.w13, bs_ptr=w.w13_scale, q_ptr=hq, q_scale_ptr=hs, expert_ptr=ids, xq_ptr=scratch, N=inter,
        a_row_div=top_k, limit=float(limit), stride_xm=x.stride(0), stride_be=w.w13.stride(0),
        stride_bse=w.w13_scale.stride(0), stride_bsn=w.w13_scale.stride(1), stride_qm=hq.stride(0), q_groups=groups,
        K=h, C=c_up, BLOCK_N=cfg.n, DECODE_ASM=decode_asm, num_warps=cfg.warps)
    _wide_down_kernel[(t * (h // cfg.n2),)](
        h_ptr=hq, h_scale_ptr=hs, b_ptr=w.w2, bs_ptr=w.w2_scale, out_ptr=res, expert_ptr=ids,
        topk_w_ptr=topk_weights.reshape(-1).to(torch.float32).contiguous(), N=h, h_groups=groups, scale=float(scaling),
        stride_hm=hq.stride(0), stride_be=w.w2.stride(0), stride_bse=w.w2_scale.stride(0),
        stride_bsn=w.w2_scale.stride(1), stride_om=res.stride(0), K=inter, C=triton.next_power_of_2(inter // CHUNK),
        TOP_K=top_k, TOP_K_P=triton.next_power_of_2(top_k), A_GROUP=cfg.n, BLOCK_N=cfg.n2, DECODE_ASM=decode_asm,
        num_warps=cfg.warps2)
