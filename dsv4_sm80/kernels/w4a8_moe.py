"""W4A8 fused MoE for SM80: MXFP4 experts stay 4-bit in memory, the GEMMs run on INT8 tensor cores.

Why Triton: the kernel must run at tiny sizes on the CPU (TRITON_INTERPRET=1) for CI, be capture-safe
for CUDA graphs, and compile for sm_80 without touching SGLang's build; Triton's `tl.dot` on int8
operands lowers to `mma.sync ... s8.s8.s32` on SM80. (A JIT CUDA kernel through SGLang's `load_jit`
would need a GPU to test at all.)

The math (reference: `w4a8_moe_ref.py`):
- An MXFP4 weight is an E2M1 code c (1 sign, 2 exponent, 1 mantissa bits) times 2^(e-127) per 32
  consecutive K. Twice an E2M1 value is an integer in {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}, so the
  kernel decodes each code to that INT8 integer q, and w = q * 2^(e-127) / 2 exactly.
- Activations are quantized to INT8 dynamically, one fp32 scale per row and group of K: the layer input
  per token (or per token and `input_group` columns), the intermediate per (token, expert) pair and
  BLOCK_N columns, computed in the gate-up kernel's epilogue (no extra pass). The intermediate's
  rounding dominates the error (silu(gate) * up is heavy-tailed); measured in tests/test_w4a8_moe.py.
- Each 32-wide K group's INT8 dot is exact in int32; by default each group is converted to fp32 and scaled
  by its power of two on its own (exact on the weight side, no condition). With config merge=True, groups
  are merged over a span of 64 or 128 K in int32 instead: each group's dot is shifted left by its exponent
  above the span's reference exponent (the span's smallest, or its largest minus 13 if the span is wider
  than 13 binades; a group further below is dropped, below 2^-13 of the largest), then one int32 -> fp32
  conversion and one power-of-two scale serve the span; exact while a span's exponents stay within 13
  binades. Session 4's H200 bench measured the per-group form faster at every size (8-16 %), so merging
  is an option, not the default. Only the activation rounding to INT8 is lossy (measured in the tests and
  the benchmark).
- The codes are widened to INT8 four per 32-bit register by inline PTX (two PRMT table lookups and a
  sign blend, `_DECODE_ASM`); Triton's CPU interpreter cannot run inline PTX, so there (and with
  config decode="alu") the same mapping is computed with integer arithmetic.
- Sorting the (token, expert) pairs by expert uses SGLang's own `moe_align_block_size` kernel on a GPU
  (`align_by_expert` is the same contract in torch, for the CPU).
- Gate-up computes the gate (rows [0, I)) and up (rows [I, 2I)) tiles of the same columns together, applies
  the clamped SiLU-GLU (gate <= limit, |up| <= limit, silu(gate) * up), and quantizes the result; the down
  kernel multiplies by the router weight; the sum over top-k and the routed scaling factor (once) follow.

Weight layout the kernels read (`repack_mxfp4_for_w4a8`, done on the GPU at load, in place, 4 bits per
weight): per expert [N, K/2] bytes where, in each 64-wide K chunk, byte j holds the code of k = j in its
low nibble and of k = 32 + j in its high nibble, so one byte tile feeds two 32-deep INT8 dots. Scales stay
the checkpoint's E8M0 bytes [N, K/32].
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import round_int8

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # inline PTX does not run in the interpreter

GROUP = 32  # MXFP4 scale group along K
CHUNK = 64  # K per byte tile: two groups, low and high nibbles


def repack_mxfp4_for_w4a8(packed: torch.Tensor, experts_per_step: int = 16) -> torch.Tensor:
    """Checkpoint MXFP4 bytes [E, N, K/2] (low nibble = even k) -> the kernel's layout, in place.

    Works expert slice by expert slice so the transient is a few experts' codes, not the layer's."""
    e_total, n, half_k = packed.shape
    k = half_k * 2
    if k % CHUNK:
        raise ValueError(f"K={k} must be a multiple of {CHUNK}")
    raw = packed.view(torch.uint8)
    for e0 in range(0, e_total, experts_per_step):
        b = raw[e0:e0 + experts_per_step]
        codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], n, k // CHUNK, 2, GROUP)
        b.copy_((codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(b.shape))
    return packed


def quantize_rows_int8(x: torch.Tensor, group: int = 0):
    """Symmetric INT8 per row (group=0) or per row and `group` columns: x ~ q * s, s = max|x| / 127
    (fp32; all-zero groups get s = 1). Rounds half away from zero, as the kernel's epilogue does.
    Returns q [rows, cols] int8 and s [rows, groups] fp32."""
    xf = x.float()
    rows, cols = xf.shape
    g = xf.view(rows, 1 if not group else cols // group, -1)
    s = g.abs().amax(dim=-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = g / s
    q = torch.clamp(torch.sign(v) * torch.floor(v.abs() + 0.5), -127, 127).to(torch.int8)
    return q.view(rows, cols), s.view(rows, -1)


@triton.jit
def _quantize_rows_kernel(x_ptr, stride_x, q_ptr, s_ptr, cols, groups,
                          GCOLS: tl.constexpr, BLOCK: tl.constexpr):
    """One (row, group of GCOLS columns) per program: `quantize_rows_int8` in one launch (the torch version
    is about a dozen elementwise kernels, most of a batch-1 decode call's launches). Same fp32 operations,
    IEEE division: bit-equal to it."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GCOLS + tl.arange(0, BLOCK)
    ok = (tl.arange(0, BLOCK) < GCOLS) & (offs < cols)
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0)
    s = tl.where(s > 0, s, 1.0)
    tl.store(q_ptr + row * cols + offs, round_int8(tl.math.div_rn(x, s)), mask=ok)
    tl.store(s_ptr + row * groups + g, s)


def quantize_rows_int8_fused(x: torch.Tensor, group: int = 0):
    """`quantize_rows_int8` as one Triton launch (the same q and s)."""
    rows, cols = x.shape
    gcols = group or cols
    if cols % gcols:
        raise ValueError(f"{cols} columns are not a whole number of groups of {gcols}")
    groups = cols // gcols
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, cols), dtype=torch.int8, device=x.device)
    s = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows, groups)](x, x.stride(0), q, s, cols, groups, GCOLS=gcols,
                                              BLOCK=triton.next_power_of_2(gcols), num_warps=4 if gcols <= 1024 else 8)
    return q, s


@triton.jit
def _sum_pairs_kernel(y_ptr, out_ptr, h, scale, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = (sum over the token's TOP_K pair rows of y) * scale, cast to out's dtype: the torch
    sum, multiply and cast of the combine in one launch."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < h
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k) * h + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * h + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _e2m1x2(c):
    """4-bit E2M1 code (int32 0..15) -> twice its value, an integer in [-12, 12]."""
    m = c & 7
    big = (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0)
    v = tl.where(m < 4, m, big)
    return tl.where(c >= 8, -v, v)


@triton.jit
def _e8m0(e):
    """E8M0 byte (int32) -> 2^(e-127) in fp32 (e=0 flushes to 0, as Marlin's MXFP4 path does)."""
    return (e << 23).to(tl.float32, bitcast=True)


# E2M1 codes -> twice their value as INT8, four bytes per 32-bit register (SWAR): the magnitude bits of
# four codes become one PRMT selector, two PRMTs look the magnitudes up in a positive and a negative
# 8-byte table, the sign bits pick per byte. About 3 instructions per code instead of ~10 on int32 lanes.
# Emulated bit for bit in tests/test_w4a8_moe.py (test_swar_decode_algorithm); on a GPU the kernel tests
# check the compiled result against the reference.
_SWAR_NIBBLE = """
    and.b32 m, {x}, 0x07070707;
    shr.b32 t, m, 4;
    or.b32 t, t, m;
    prmt.b32 sel, t, 0, 0x4420;
    prmt.b32 pos, lp, hp, sel;
    prmt.b32 neg, ln, hn, sel;
    and.b32 sg, {x}, 0x08080808;
    shr.b32 sg, sg, 3;
    mul.lo.u32 sg, sg, 255;
    and.b32 neg, neg, sg;
    not.b32 sg, sg;
    and.b32 pos, pos, sg;
    or.b32 {out}, pos, neg;
"""
_DECODE_ASM = ("{\n.reg .b32 m, t, sel, pos, neg, sg, hi4, lp, hp, ln, hn;\n"
               "mov.b32 lp, 0x03020100;\nmov.b32 hp, 0x0C080604;\n"
               "mov.b32 ln, 0xFDFEFF00;\nmov.b32 hn, 0xF4F8FAFC;\n"
               + _SWAR_NIBBLE.format(x="$2", out="$0")
               + "shr.b32 hi4, $2, 4;\n"
               + _SWAR_NIBBLE.format(x="hi4", out="$1")
               + "}")
_DECODE_ASM_C = tl.constexpr(_DECODE_ASM)


@triton.jit
def _decode_pair(byte, DECODE_ASM: tl.constexpr):
    """A uint8 tile of packed codes -> (low-nibble codes, high-nibble codes) as INT8 twice-values."""
    if DECODE_ASM:
        lo, hi = tl.inline_asm_elementwise(_DECODE_ASM_C, "=r,=r,r", [byte], dtype=(tl.int8, tl.int8),
                                           is_pure=True, pack=4)
    else:
        b = byte.to(tl.int32) & 0xFF
        lo = _e2m1x2(b & 0xF).to(tl.int8)
        hi = _e2m1x2(b >> 4).to(tl.int8)
    return lo, hi


@triton.jit
def _w4_dots(a0, a1, b_ptrs, s_ptrs, n_ok, DECODE_ASM: tl.constexpr):
    """One 64-deep K step against one byte tile, per group (activation scale per 32 columns): the two
    32-deep INT8 dots (low nibbles = k0..k0+31, high = k0+32..k0+63), each scaled by its own group's
    E8M0 weight scale, in fp32."""
    byte = tl.load(b_ptrs, mask=n_ok[None, :], other=0)
    s0 = _e8m0(tl.load(s_ptrs, mask=n_ok, other=0).to(tl.int32) & 0xFF)
    s1 = _e8m0(tl.load(s_ptrs + 1, mask=n_ok, other=0).to(tl.int32) & 0xFF)
    lo, hi = _decode_pair(byte, DECODE_ASM)
    d0 = tl.dot(a0, lo, out_dtype=tl.int32).to(tl.float32) * s0[None, :]
    d1 = tl.dot(a1, hi, out_dtype=tl.int32).to(tl.float32) * s1[None, :]
    return d0, d1


@triton.jit
def _shifted(d, sh):
    """An exact int32 group dot moved to the span's reference exponent: d * 2^sh for sh >= 0; a group more
    than SPREAD binades below the span's largest is dropped (below 2^-13 of it; never in a checkpoint)."""
    return tl.where(sh[None, :] >= 0, d << tl.maximum(sh, 0)[None, :], 0)


@triton.jit
def _span_ref(s_ptrs, n_ok, G: tl.constexpr, SPREAD: tl.constexpr):
    """Scale bytes of a span's G groups [N, G] -> (shift per group above the reference, reference e)."""
    offs_g = tl.arange(0, G)
    e = tl.load(s_ptrs[:, None] + offs_g[None, :], mask=n_ok[:, None], other=0).to(tl.int32) & 0xFF
    e_ref = tl.maximum(tl.min(e, axis=1), tl.max(e, axis=1) - SPREAD)
    return e - e_ref[:, None], e_ref


@triton.jit
def _group_shift(sh, g, G: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, G)[None, :] == g, sh, 0), axis=1)


@triton.jit
def _w4_span(a_ptrs, row_ok, b_ptrs, s_ptrs, n_ok, up_b, up_s,
             GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             SPAN: tl.constexpr, SPREAD: tl.constexpr, DECODE_ASM: tl.constexpr):
    """SPAN deep K (SPAN/32 scale groups) against one weight tile (and, GATED, the up tile `up_b` /
    `up_s` rows further, sharing the activation loads), accumulated exactly in int32: each group's
    INT8 dot is shifted by its exponent above the span's reference exponent e_ref = max(min e, max e -
    SPREAD), so one int32 -> fp32 conversion and one scale multiply serve the whole span
    (|sum| <= 127 * 12 * 32 * 2^SPREAD * groups < 2^31 for SPREAD 13, 4 groups). Returns fp32 [M, N]
    partials (gate, up); up is zeros when not GATED."""
    G: tl.constexpr = SPAN // 32
    sh, e_ref = _span_ref(s_ptrs, n_ok, G, SPREAD)
    iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    iacc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if GATED:
        sh_up, e_ref_up = _span_ref(s_ptrs + up_s, n_ok, G, SPREAD)
    for c in tl.static_range(SPAN // 64):
        a0 = tl.load(a_ptrs + c * 64, mask=row_ok[:, None], other=0)
        a1 = tl.load(a_ptrs + c * 64 + 32, mask=row_ok[:, None], other=0)
        lo, hi = _decode_pair(tl.load(b_ptrs + c * 32, mask=n_ok[None, :], other=0), DECODE_ASM)
        iacc += _shifted(tl.dot(a0, lo, out_dtype=tl.int32), _group_shift(sh, 2 * c, G))
        iacc += _shifted(tl.dot(a1, hi, out_dtype=tl.int32), _group_shift(sh, 2 * c + 1, G))
        if GATED:
            lo, hi = _decode_pair(tl.load(b_ptrs + up_b + c * 32, mask=n_ok[None, :], other=0), DECODE_ASM)
            iacc_up += _shifted(tl.dot(a0, lo, out_dtype=tl.int32), _group_shift(sh_up, 2 * c, G))
            iacc_up += _shifted(tl.dot(a1, hi, out_dtype=tl.int32), _group_shift(sh_up, 2 * c + 1, G))
    gate = iacc.to(tl.float32) * _e8m0(e_ref)[None, :]
    if GATED:
        up = iacc_up.to(tl.float32) * _e8m0(e_ref_up)[None, :]
    else:
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return gate, up


@triton.jit
def _w4a8_moe_kernel(
    a_ptr, a_scale_ptr, b_ptr, bs_ptr, c_ptr, c_scale_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_w_ptr,
    N, K, num_pairs, a_row_div, a_scale_groups, limit,
    stride_am, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, c_scale_groups,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr = 32, DECODE_ASM: tl.constexpr = False,
):
    """SPAN = 32: every scale group converted to fp32 on its own (needed when the activation scale
    changes every 32 columns). SPAN = 64 or 128: groups merged in int32 over the span (`_w4_span`); the
    activation scale, if grouped, is constant over the span (A_GROUP == SPAN)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    row_ok = ids < num_pairs
    a_rows = tl.where(row_ok, ids // a_row_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_j = tl.arange(0, 32)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + expert * stride_be
    bs_base = bs_ptr + expert * stride_bse
    if SPAN == 32:
        for k0 in range(0, K, 64):
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k0 + offs_j)[None, :]
            a0 = tl.load(a_ptrs, mask=row_ok[:, None], other=0)
            a1 = tl.load(a_ptrs + 32, mask=row_ok[:, None], other=0)
            if A_GROUP:  # activation scale per (row, group of A_GROUP columns of K; a multiple of 32)
                sa0 = tl.load(a_scale_ptr + a_rows * a_scale_groups + k0 // A_GROUP, mask=row_ok, other=0.0)
                sa1 = tl.load(a_scale_ptr + a_rows * a_scale_groups + (k0 + 32) // A_GROUP, mask=row_ok, other=0.0)
            b_ptrs = b_base + offs_n[None, :] * stride_bn + (k0 // 2 + offs_j)[:, None]
            s_ptrs = bs_base + offs_n * stride_bsn + k0 // 32
            d0, d1 = _w4_dots(a0, a1, b_ptrs, s_ptrs, n_ok, DECODE_ASM)
            if A_GROUP:
                acc += d0 * sa0[:, None] + d1 * sa1[:, None]
            else:
                acc += d0 + d1
            if GATED:  # the up rows of the same columns sit N rows further
                d0, d1 = _w4_dots(a0, a1, b_ptrs + N * stride_bn, s_ptrs + N * stride_bsn, n_ok, DECODE_ASM)
                if A_GROUP:
                    acc_up += d0 * sa0[:, None] + d1 * sa1[:, None]
                else:
                    acc_up += d0 + d1
    else:
        for k0 in range(0, K, SPAN):
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k0 + offs_j)[None, :]
            b_ptrs = b_base + offs_n[None, :] * stride_bn + (k0 // 2 + offs_j)[:, None]
            s_ptrs = bs_base + offs_n * stride_bsn + k0 // 32
            gate, up = _w4_span(a_ptrs, row_ok, b_ptrs, s_ptrs, n_ok, N * stride_bn, N * stride_bsn,
                                GATED, BLOCK_M, BLOCK_N, SPAN, 13, DECODE_ASM)
            if A_GROUP:
                sa = tl.load(a_scale_ptr + a_rows * a_scale_groups + k0 // A_GROUP, mask=row_ok, other=0.0)
                acc += gate * sa[:, None]
                acc_up += up * sa[:, None]
            else:
                acc += gate
                acc_up += up

    if not A_GROUP:  # one activation scale per row
        sa = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)
        acc = acc * sa[:, None]
        acc_up = acc_up * sa[:, None]
    acc = acc * 0.5  # the codes were twice the E2M1 values
    out_rows = tl.where(row_ok, ids, 0).to(tl.int64)
    if GATED:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up * 0.5, -limit), limit)
        h = gate * tl.sigmoid(gate) * up
        h = tl.where(n_ok[None, :], h, 0.0)
        # INT8 per (pair, this tile's columns): the scale the down kernel reads per K group
        s = tl.max(tl.abs(h), axis=1) / 127.0
        s = tl.where(s > 0, s, 1.0)
        q = round_int8(h / s[:, None])
        tl.store(c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :], q,
                 mask=row_ok[:, None] & n_ok[None, :])
        tl.store(c_scale_ptr + out_rows * c_scale_groups + pid_n, s, mask=row_ok)
    else:
        if MUL_WEIGHT:
            w = tl.load(topk_w_ptr + out_rows, mask=row_ok, other=0.0)
            acc = acc * w[:, None]
        tl.store(c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_ok[None, :])


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


def _span(k: int, a_group: int, merge: bool) -> int:
    """K per int32-merged span: the largest of 128 and 64 that divides K and, when the activation scale
    is grouped, its group (the activation scale must be constant over a span); 32 = no merging."""
    if merge:
        for span in (128, 64):
            if k % span == 0 and (a_group == 0 or a_group % span == 0):
                return span
    return GROUP


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`align_by_expert`, or on a GPU SGLang's own moe_align_block_size (one kernel instead of ~15
    small ones; the same contract: padding ids = number of pairs, blocks past the end never read)."""
    if topk_ids.is_cuda and not _INTERPRETED:
        try:
            from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import moe_align_block_size
        except ImportError:
            moe_align_block_size = None
        if moe_align_block_size is not None:
            return moe_align_block_size(topk_ids, block_m, num_experts)
    return align_by_expert(topk_ids, num_experts, block_m)


def default_config(pairs: int) -> dict:
    """Tile sizes by the number of (token, expert) pairs; a starting point, to be tuned on an A800.
    block_n is also the intermediate's INT8 group (a multiple of 32)."""
    if pairs <= 64:  # decode: few rows per expert, parallelism must come from N
        return {"block_m": 16, "block_n": 32, "block_n2": 64, "num_warps": 4, "num_stages": 3}
    if pairs <= 4096:
        return {"block_m": 32, "block_n": 64, "block_n2": 64, "num_warps": 4, "num_stages": 3}
    return {"block_m": 64, "block_n": 64, "block_n2": 128, "num_warps": 8, "num_stages": 3}


def w4a8_moe(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, swiglu_limit: float = 10.0,
    routed_scaling_factor: float = 1.0, input_group: int = 0, config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed-expert output for x [T, H] (bf16): sum_k w_k * down_e(act(gate_up_e(x))) * scaling.

    w13 [E, 2I, H/2] and w2 [E, H, I/2]: MXFP4 bytes in the kernel layout (repack_mxfp4_for_w4a8);
    scales [E, 2I, H/32], [E, H, I/32]: E8M0 (float8_e8m0fnu or uint8). topk_* [T, top_k]."""
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    cfg = dict(default_config(t * top_k), **(config or {}))
    block_m, block_n, block_n2 = cfg["block_m"], cfg["block_n"], cfg["block_n2"]
    if h % CHUNK or inter % CHUNK or inter % block_n or block_n % GROUP:
        raise ValueError(f"hidden {h} and intermediate {inter} must be multiples of {CHUNK}, intermediate "
                         f"of block_n={block_n}, and block_n of {GROUP}")
    pairs = t * top_k
    dev = x.device
    sorted_ids, block_expert, num_padded = _align(topk_ids, e, block_m)
    if input_group % GROUP:
        raise ValueError(f"input_group={input_group} must be a multiple of {GROUP} (0: one scale per token)")
    merge = cfg.get("merge", False)  # per-group: faster on the H200 (docs/moe.md)
    span_up = _span(h, input_group, merge)
    span_down = _span(inter, block_n, merge)
    decode_asm = cfg.get("decode", "asm" if x.is_cuda and not _INTERPRETED else "alu") == "asm"
    fused_io = cfg.get("fused_io", False)  # one-launch quantize and combine; off until measured (bench --variants)
    xq, xs = (quantize_rows_int8_fused if fused_io else quantize_rows_int8)(x, input_group)
    hq = torch.empty((pairs, inter), dtype=torch.int8, device=dev)
    groups = inter // block_n
    hs = torch.empty((pairs, groups), dtype=torch.float32, device=dev)
    w13b, w13s = w13.view(torch.uint8), w13_scale.view(torch.uint8)
    w2b, w2s = w2.view(torch.uint8), w2_scale.view(torch.uint8)
    blocks = block_expert.numel()
    _w4a8_moe_kernel[(blocks * triton.cdiv(inter, block_n),)](
        xq, xs, w13b, w13s, hq, hs, sorted_ids, block_expert, num_padded, topk_weights,
        inter, h, pairs, top_k, xs.shape[1], float(swiglu_limit),
        xq.stride(0), w13b.stride(0), w13b.stride(1), w13s.stride(0), w13s.stride(1), hq.stride(0), groups,
        GATED=True, MUL_WEIGHT=False, A_GROUP=input_group, BLOCK_M=block_m, BLOCK_N=block_n,
        SPAN=span_up, DECODE_ASM=decode_asm, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    y = torch.empty((pairs, h), dtype=torch.float32, device=dev)
    tw = topk_weights.reshape(-1).to(torch.float32)
    _w4a8_moe_kernel[(blocks * triton.cdiv(h, block_n2),)](
        hq, hs, w2b, w2s, y, y, sorted_ids, block_expert, num_padded, tw,
        h, inter, pairs, 1, groups, 0.0,
        hq.stride(0), w2b.stride(0), w2b.stride(1), w2s.stride(0), w2s.stride(1), y.stride(0), 0,
        GATED=False, MUL_WEIGHT=True, A_GROUP=block_n, BLOCK_M=block_m, BLOCK_N=block_n2,
        SPAN=span_down, DECODE_ASM=decode_asm, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if fused_io and (out is None or out.is_contiguous()):
        res = torch.empty((t, h), dtype=x.dtype, device=dev) if out is None else out
        if t:
            _sum_pairs_kernel[(t, triton.cdiv(h, 1024))](y, res, h, float(routed_scaling_factor), TOP_K=top_k,
                                                         BLOCK=1024, num_warps=4)
        return res
    summed = y.view(t, top_k, h).sum(dim=1)
    if routed_scaling_factor != 1.0:
        summed.mul_(routed_scaling_factor)
    if out is None:
        return summed.to(x.dtype)
    return out.copy_(summed)
