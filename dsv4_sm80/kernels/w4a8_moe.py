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
- The codes are widened to INT8 four per 32-bit register by inline PTX (`_DECODE_ASM`: per 32-bit word =
  8 codes, three PRMTs and one LOP3 per four codes, 11 instructions); Triton's CPU interpreter cannot run
  inline PTX, so there (and with config decode="alu") the same mapping is computed elementwise.
- Shift path (config shift; `default_config` turns it on for prefill, > 4096 pairs, and off at decode,
  where session 7's H200 bench measured it slower; given the shift maps `w13_eref` / `w2_eref` from `shift_refs`,
  computed once at load: 1 byte per expert and output row, ~0.003 bits/weight): UE8M0 scales are powers of
  two, so for a column whose group exponents span at most 3 binades (and none is 0) the decoder emits
  q * 2^(e - e_ref) (|q * 2^s| <= 96, still exact INT8), the INT8 dots accumulate in int32 over the whole K
  (gate-up: one activation scale per token) or over each activation group (down: A_GROUP = the gate-up
  block_n, a multiple of 64; block_n 32 keeps that launch per group), and one int32 -> fp32 conversion
  times 2^(e_ref - 127) replaces one per 32-deep dot (|sum| <= 127 * 96 * K < 2^31 for K < 176k; the
  conversion rounds like one fp32 accumulation once |sum| > 2^24). Each program checks its tile's columns
  (gate and up rows) once and runs either the shift loop or the exact per-group loop, so non-shiftable
  experts stay exact; a map that does not belong to the scales (a shift outside 0..3) gives NaN.
- Expanded path (config expand; `default_config` above 8192 tokens when the caller says every column of both maps
  is shiftable, `expand_ok`): `_expand_kernel` writes the shift decoder's integers of a share of the experts
  (`expand_mb`, 512 MiB) row-major into a transient INT8 workspace once per call, and `_w8_moe_kernel` runs the
  shift loop's int32 sums on them as a plain INT8 grouped GEMM (pipelined operand loads, no decode in the K loop):
  bit-equal to the shift loop; an unshiftable column or a map not of these scales gives NaN.
- Sorting the (token, expert) pairs by expert uses SGLang's own `moe_align_block_size` kernel on a GPU
  (`align_by_expert` is the same contract in torch, for the CPU).
- Gate-up computes the gate (rows [0, I)) and up (rows [I, 2I)) tiles of the same columns together, applies
  the clamped SiLU-GLU (gate <= limit, |up| <= limit, silu(gate) * up), and quantizes the result; the down
  kernel multiplies by the router weight; the sum over top-k and the routed scaling factor (once) follow.

Weight layout the kernels read (`repack_mxfp4_for_w4a8`, done on the GPU at load, in place, 4 bits per
weight): per expert [N, K/2] bytes where, in each 64-wide K chunk (32 bytes), the little-endian 32-bit word
q holds as nibbles 0..3 the codes of k = 4q..4q+3 and as nibbles 4..7 those of k = 32+4q..32+4q+3 (byte
4q+b: nibbles 2b, 2b+1), so one byte tile feeds two 32-deep INT8 dots and one word gives four operands of
each. The chunks are stored tile-major, [N/32, K/64, 32 rows, 32 bytes] per expert, so one K step of a
32-row column tile is one contiguous 1 KiB block (row-major rows would put its 32-byte pieces K/2 bytes
apart); N must be a multiple of 32. Scales stay the checkpoint's E8M0 bytes [N, K/32].
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
TILE_COLS = 32  # output rows whose chunks sit side by side: one 1 KiB block per 32 rows and K chunk


def repack_mxfp4_for_w4a8(packed: torch.Tensor, experts_per_step: int = 16) -> torch.Tensor:
    """Checkpoint MXFP4 bytes [E, N, K/2] (low nibble = even k) -> the kernel's layout, in place.

    Per 64-wide K chunk (32 bytes) of a row: the 32-bit little-endian word q (bytes 4q..4q+3) holds, as
    nibbles 0..3, the codes of k = 4q..4q+3 (the chunk's first scale group) and, as nibbles 4..7, those of
    k = 32+4q..32+4q+3 (its second), i.e. byte 4q+b holds nibbles 2b (low) and 2b+1 (high). One word then
    decodes to four INT8 operands of each group's dot with a single PRMT selector per group.
    Chunks are stored tile-major: per expert [N/32, K/64, 32 rows, 32 bytes], so the 32 rows' bytes of one
    K chunk are one contiguous 1 KiB block (a K step of a 32-wide column tile reads it whole, instead of 32
    bytes from each of 32 rows K/2 bytes apart). Byte (n, chunk c, j) is at
    (n // 32) * 16K + c * 1024 + (n % 32) * 32 + j (`_col_base`).
    Works expert slice by expert slice so the transient is a few experts' codes, not the layer's."""
    e_total, n, half_k = packed.shape
    k = half_k * 2
    if k % CHUNK or n % TILE_COLS:
        raise ValueError(f"K={k} must be a multiple of {CHUNK} and N={n} of {TILE_COLS}")
    raw = packed.view(torch.uint8)
    for e0 in range(0, e_total, experts_per_step):
        b = raw[e0:e0 + experts_per_step]
        # [.., chunk, group, q, i]: k = 64*chunk + 32*group + 4*q + i
        codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], n, k // CHUNK, 2, 8, 4)
        nib = codes.permute(0, 1, 2, 4, 3, 5).reshape(b.shape[0], n, k // CHUNK, 8, 4, 2)  # [q, b, nibble]
        words = (nib[..., 0] | (nib[..., 1] << 4)).reshape(b.shape[0], n // TILE_COLS, TILE_COLS, k // CHUNK, 32)
        b.copy_(words.permute(0, 1, 3, 2, 4).reshape(b.shape))  # tile-major: [N/32, K/64, 32 rows, 32 B]
    return packed


def shift_refs(scale: torch.Tensor, experts_per_step: int = 16) -> torch.Tensor:
    """E8M0 scale bytes [E, N, K/32] -> the shift map `eref` uint8 [E, N] the kernel's shift path reads.

    A column (one output row of the weight, all its K groups) is shiftable when its exponents span at most
    3 binades and none is 0 (E8M0 0 flushes to zero in the per-group path): then every group's codes times
    2^(e - e_ref), e_ref = the column's smallest exponent, are integers of |q| <= 12 * 8 = 96, exact in
    INT8, and the whole K of INT8 dots can accumulate in int32 with one conversion and one 2^(e_ref-127).
    eref[e, n] = e_ref for a shiftable column, 0 for one that is not (the per-group path serves it)."""
    s = scale.view(torch.uint8)
    out = torch.empty(s.shape[:2], dtype=torch.uint8, device=s.device)
    for e0 in range(0, s.shape[0], experts_per_step):
        part = s[e0:e0 + experts_per_step]
        lo, hi = part.amin(dim=-1), part.amax(dim=-1)
        out[e0:e0 + experts_per_step] = torch.where((hi - lo <= 3) & (lo > 0), lo, torch.zeros_like(lo))
    return out


def _group_cols(cols: int, group: int) -> int:
    """Columns per quantization group (group 0: the whole row); cols must be a whole number of groups."""
    gcols = group or cols
    if cols % gcols:
        raise ValueError(f"{cols} columns are not a whole number of groups of {gcols}")
    return gcols


def quantize_rows_int8(x: torch.Tensor, group: int = 0):
    """Symmetric INT8 per row (group=0) or per row and `group` columns: x ~ q * s, s = max|x| / 127
    (fp32; all-zero groups get s = 1). Rounds half away from zero, as the kernel's epilogue does.
    Returns q [rows, cols] int8 and s [rows, groups] fp32."""
    xf = x.float()
    rows, cols = xf.shape
    gcols = _group_cols(cols, group)
    g = xf.view(rows, cols // gcols, gcols)  # explicit sizes: a view of 0 rows cannot infer a -1
    amax = g.abs().amax(dim=-1, keepdim=True)
    # a tensor divisor: PyTorch's CUDA division by a Python scalar multiplies by its reciprocal, one ulp off the
    # quotient in some rows (measured on the H200, session 14), so q then differs from the fused kernel's
    s = amax / torch.full_like(amax, 127.0)
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = g / s
    q = torch.clamp(torch.sign(v) * torch.floor(v.abs() + 0.5), -127, 127).to(torch.int8)
    return q.view(rows, cols), s.view(rows, cols // gcols)


@triton.jit
def _int8_scale(amax):
    """The INT8 scale of a group with max|x| = amax: amax / 127 by IEEE division, 1 for an all-zero group (what
    `quantize_rows_int8` computes; the fused quantizer of the layer input goes through this)."""
    s = tl.math.div_rn(amax, 127.0)
    return tl.where(s > 0, s, 1.0)


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
    s = _int8_scale(tl.max(tl.abs(x), axis=0))
    tl.store(q_ptr + row * cols + offs, round_int8(tl.math.div_rn(x, s)), mask=ok)
    tl.store(s_ptr + row * groups + g, s)


def quantize_rows_int8_fused(x: torch.Tensor, group: int = 0):
    """`quantize_rows_int8` as one Triton launch (the same q and s)."""
    rows, cols = x.shape
    gcols = _group_cols(cols, group)
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
        acc += tl.load(y_ptr + (t * TOP_K + k) * h + offs, mask=ok, other=0.0).to(tl.float32)
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


# E2M1 codes -> twice their value as INT8, four bytes per 32-bit register (SWAR), for the repacked layout
# (`repack_mxfp4_for_w4a8`): one 32-bit word x holds 4 codes of the chunk's first scale group (nibbles
# 0..3, bits 0-15) and the 4 codes 32 further (nibbles 4..7). PRMT's default mode reads its selector's low
# 16 bits: result byte i = byte (nibble i of c) & 7 of {b:a} (a = bytes 0..3), and if bit 3 of that nibble
# is set, that byte's msb replicated (sign-replicate). So x & 0x77777777 is the selector of group 0's four
# magnitudes, >> 16 that of group 1's; two 8-byte tables (0,1,2,3,4,6,8,12 and their negatives) give
# the positive and negative values; a third PRMT in sign-replicate mode builds the mask 0xFF per byte whose
# code is negative (x << 4 brings the even nibbles' sign bits to byte msbs, x has the odd nibbles'); one
# LOP3 (0xD8: c ? b : a) blends. 11 instructions per word = 8 codes. Emulated instruction by instruction
# in tests/test_w4a8_moe.py (test_swar_decode_algorithm).
#
# Relies on the 4 bytes Triton packs into one register (pack=4) being 4 consecutive k of one column,
# aligned to 4: true in the INT8 MMA operand layout the decode runs in (the m16n8k32 B fragment holds
# exactly such words; the compile test checks that the decode runs in that layout).
_DECODE_HEAD = ("{\n.reg .b32 sel, selh, sx, sg, pos, neg, lp, hp, ln, hn;\n"
                "mov.b32 lp, 0x03020100;\nmov.b32 hp, 0x0C080604;\n"
                "and.b32 sel, $2, 0x77777777;\nshr.b32 selh, sel, 16;\nshl.b32 sx, $2, 4;\n")
_DECODE_ASM = (_DECODE_HEAD + "mov.b32 ln, 0xFDFEFF00;\nmov.b32 hn, 0xF4F8FAFC;\n"
               + "".join(f"prmt.b32 pos, lp, hp, {s};\nprmt.b32 neg, ln, hn, {s};\n"
                         f"prmt.b32 sg, $2, sx, {m};\nlop3.b32 {o}, pos, neg, sg, 0xD8;\n"
                         for s, m, o in (("sel", "0x9D8C", "$0"), ("selh", "0xBFAE", "$1")))
               + "}")
# The shift path's decoder: codes times 2^s, s = 0..3 per column and group, given as the multiplier
# m = 2^s (operand $3: each byte m0 | m1 << 4 for the low and high group). After the positive lookup P
# (bytes <= 12), v = P * m + M with M = 0x7F where the code is negative (else 0): bytes P*m <= 96, so
# neither the multiply nor the add carries across bytes (<= 96 + 127 < 256); then v ^ M is P*m where
# M = 0 and (0x7F + q) ^ 0x7F = 256 - q = -q mod 256 where M = 0x7F (0 <= q <= 0x80). 15 per word.
_DECODE_SHIFT_ASM = (_DECODE_HEAD.replace("lp, hp, ln, hn", "lp, hp, m0, m1, v")
                     + "and.b32 m0, $3, 15;\nbfe.u32 m1, $3, 4, 4;\n"
                     + "".join(f"prmt.b32 pos, lp, hp, {s};\nprmt.b32 sg, $2, sx, {m};\n"
                               f"and.b32 sg, sg, 0x7F7F7F7F;\nmad.lo.u32 v, pos, {mm}, sg;\n"
                               f"xor.b32 {o}, v, sg;\n"
                               for s, m, mm, o in (("sel", "0x9D8C", "m0", "$0"), ("selh", "0xBFAE", "m1", "$1")))
                     + "}")
_DECODE_ASM_C = tl.constexpr(_DECODE_ASM)
_DECODE_SHIFT_ASM_C = tl.constexpr(_DECODE_SHIFT_ASM)


@triton.jit
def _col_base(offs_n, stride_bn):
    """Byte offset of column (output row) n's first K chunk in the tile-major layout (stride_bn = K/2, the
    bytes of one row): 32-row tiles of 16K bytes, each row's chunk 32 bytes into its tile's 1 KiB block.
    Chunk c of the row is 1024 * c further."""
    return (offs_n // 32) * (stride_bn * 32) + (offs_n % 32) * 32


@triton.jit
def _load_codes(b_ptrs, n_ok, mul, DECODE_ASM: tl.constexpr, SHIFT: tl.constexpr):
    """b_ptrs [32, BLOCK_N]: the 32 bytes of one 64-wide K chunk per column (row j = byte j). Returns
    (lo, hi) INT8 [32, BLOCK_N]: lo[j] = twice the E2M1 value of code k0+j, hi[j] = of code k0+32+j; with
    SHIFT, times the column's 2^s per group, mul [BLOCK_N] = m0 | m1 << 4 (m = 2^s, 1..8)."""
    if DECODE_ASM:
        byte = tl.load(b_ptrs, mask=n_ok[None, :], other=0)
        if SHIFT:
            m = tl.broadcast_to(mul.to(tl.uint8)[None, :], byte.shape)
            lo, hi = tl.inline_asm_elementwise(_DECODE_SHIFT_ASM_C, "=r,=r,r,r", [byte, m],
                                               dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_DECODE_ASM_C, "=r,=r,r", [byte], dtype=(tl.int8, tl.int8),
                                               is_pure=True, pack=4)
    else:  # elementwise (interpreter): gather code k0+j from byte 4*(j//4) + (j%4)//2, nibble j%2 (+2: k0+32+j)
        j = tl.arange(0, 32)
        delta = ((j // 4) * 4 + (j % 4) // 2 - j)[:, None]
        nib = ((j % 2) * 4)[:, None]
        blo = tl.load(b_ptrs + delta, mask=n_ok[None, :], other=0).to(tl.int32) & 0xFF
        bhi = tl.load(b_ptrs + delta + 2, mask=n_ok[None, :], other=0).to(tl.int32) & 0xFF
        vlo = _e2m1x2((blo >> nib) & 0xF)
        vhi = _e2m1x2((bhi >> nib) & 0xF)
        if SHIFT:
            vlo = vlo * (mul & 15)[None, :]
            vhi = vhi * (mul >> 4)[None, :]
        lo = vlo.to(tl.int8)
        hi = vhi.to(tl.int8)
    return lo, hi


@triton.jit
def _scale_word(s_ptrs, n_ok):
    """A 64-deep K step's two E8M0 bytes per column (groups k0/32 and k0/32 + 1: adjacent, the pair 2-aligned
    as K/32 is even) in one 16-bit load, as int32 (low byte the first group); 0 where n_ok is false."""
    return tl.load(s_ptrs.to(tl.pointer_type(tl.uint16)), mask=n_ok, other=0).to(tl.int32)


@triton.jit
def _word_scales(sw):
    """A `_scale_word` as its two groups' fp32 weight scales (s0, s1)."""
    return _e8m0(sw & 0xFF), _e8m0(sw >> 8)


@triton.jit
def _scale_bytes(s_ptrs, n_ok):
    """`_scale_word` split into (e0, e1)."""
    v = _scale_word(s_ptrs, n_ok)
    return v & 0xFF, v >> 8


@triton.jit
def _w4_dots(a0, a1, b_ptrs, s_ptrs, n_ok, DECODE_ASM: tl.constexpr):
    """One 64-deep K step against one byte tile, per group: the two 32-deep INT8 dots (k0..k0+31 and
    k0+32..k0+63) as exact fp32 values, and their groups' E8M0 weight scales; the caller multiplies and
    accumulates (one FFMA per group and element)."""
    s0, s1 = _word_scales(_scale_word(s_ptrs, n_ok))
    lo, hi = _load_codes(b_ptrs, n_ok, 0, DECODE_ASM, False)
    d0 = tl.dot(a0, lo, out_dtype=tl.int32).to(tl.float32)
    d1 = tl.dot(a1, hi, out_dtype=tl.int32).to(tl.float32)
    return d0, d1, s0, s1


@triton.jit
def _shift_step(a0, a1, b_ptrs, s_ptrs, eref, n_ok, iacc, bad, DECODE_ASM: tl.constexpr):
    """Shift path, one 64-deep K step: both groups' codes times 2^(e - eref) (the column's reference
    exponent), INT8 dots accumulated straight into the int32 `iacc`. `bad` collects, per column, any
    shift outside 0..3 (a map that does not belong to these scales): the result is made NaN there,
    never silently wrong."""
    e0, e1 = _scale_bytes(s_ptrs, n_ok)
    d0 = e0 - eref
    d1 = e1 - eref
    bad = bad | tl.where(n_ok, (d0 | d1) & ~3, 0)
    mul = (1 << (d0 & 3)) | ((1 << (d1 & 3)) << 4)
    lo, hi = _load_codes(b_ptrs, n_ok, mul, DECODE_ASM, True)
    iacc = tl.dot(a0, lo, iacc, out_dtype=tl.int32)
    iacc = tl.dot(a1, hi, iacc, out_dtype=tl.int32)
    return iacc, bad


@triton.jit
def _shift_chunk(k0, a_ptr, a_rows, row_ok, stride_am, b_base, bs_base, offs_n, n_ok, er, er_up, N, stride_bn,
                 stride_bsn, iacc, iacc_up, bad, GATED: tl.constexpr, DECODE_ASM: tl.constexpr):
    """The 64-deep K step at k0 of the shift path: activation loads shared by the gate and up tiles."""
    offs_j = tl.arange(0, 32)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k0 + offs_j)[None, :]
    a0 = tl.load(a_ptrs, mask=row_ok[:, None], other=0)
    a1 = tl.load(a_ptrs + 32, mask=row_ok[:, None], other=0)
    b_ptrs = b_base + _col_base(offs_n, stride_bn)[None, :] + (k0 * 16 + offs_j)[:, None]
    s_ptrs = bs_base + offs_n * stride_bsn + k0 // 32
    iacc, bad = _shift_step(a0, a1, b_ptrs, s_ptrs, er, n_ok, iacc, bad, DECODE_ASM)
    if GATED:  # the up rows of the same columns sit N rows further
        iacc_up, bad = _shift_step(a0, a1, b_ptrs + N * stride_bn, s_ptrs + N * stride_bsn, er_up, n_ok, iacc_up,
                                   bad, DECODE_ASM)
    return iacc, iacc_up, bad


@triton.jit
def _shift_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base, offs_n, n_ok,
                er, er_up, N, K, stride_bn, stride_bsn,
                GATED: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DECODE_ASM: tl.constexpr):
    """The whole K for a tile whose columns are all shiftable: int32 accumulation, one int32 -> fp32
    conversion per activation-scale change (A_GROUP = 0: once at the end; else per A_GROUP columns of K,
    a multiple of 64), times 2^(eref - 127) per column at the end. Returns fp32 (gate, up) as the
    per-group loop does: the per-row activation scale for A_GROUP = 0 is still to be applied.
    |iacc| <= 127 * 96 * K < 2^31 for K < 176k (checked by the caller)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bad = tl.zeros((BLOCK_N,), dtype=tl.int32)
    iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    iacc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if A_GROUP == 0:  # one activation scale per row: the whole K in int32
        for k0 in range(0, K, 64):
            iacc, iacc_up, bad = _shift_chunk(k0, a_ptr, a_rows, row_ok, stride_am, b_base, bs_base, offs_n, n_ok,
                                              er, er_up, N, stride_bn, stride_bsn, iacc, iacc_up, bad,
                                              GATED, DECODE_ASM)
        acc = iacc.to(tl.float32)
        acc_up = iacc_up.to(tl.float32)
    else:  # one conversion per A_GROUP columns of K, times that group's activation scale
        for kg in range(0, K, A_GROUP):
            iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            iacc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            if A_GROUP <= 256:
                for kk in tl.static_range(0, A_GROUP, 64):
                    iacc, iacc_up, bad = _shift_chunk(kg + kk, a_ptr, a_rows, row_ok, stride_am, b_base, bs_base,
                                                      offs_n, n_ok, er, er_up, N, stride_bn, stride_bsn, iacc,
                                                      iacc_up, bad, GATED, DECODE_ASM)
            else:
                for kk in range(0, A_GROUP, 64):
                    iacc, iacc_up, bad = _shift_chunk(kg + kk, a_ptr, a_rows, row_ok, stride_am, b_base, bs_base,
                                                      offs_n, n_ok, er, er_up, N, stride_bn, stride_bsn, iacc,
                                                      iacc_up, bad, GATED, DECODE_ASM)
            sa = tl.load(a_scale_ptr + a_rows * a_scale_groups + kg // A_GROUP, mask=row_ok, other=0.0)
            acc += iacc.to(tl.float32) * sa[:, None]
            acc_up += iacc_up.to(tl.float32) * sa[:, None]
    acc = tl.where(bad[None, :] != 0, float("nan"), acc * _e8m0(er)[None, :])
    if GATED:
        acc_up = tl.where(bad[None, :] != 0, float("nan"), acc_up * _e8m0(er_up)[None, :])
    return acc, acc_up


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
        lo, hi = _load_codes(b_ptrs + c * 1024, n_ok, 0, DECODE_ASM, False)
        iacc += _shifted(tl.dot(a0, lo, out_dtype=tl.int32), _group_shift(sh, 2 * c, G))
        iacc += _shifted(tl.dot(a1, hi, out_dtype=tl.int32), _group_shift(sh, 2 * c + 1, G))
        if GATED:
            lo, hi = _load_codes(b_ptrs + up_b + c * 1024, n_ok, 0, DECODE_ASM, False)
            iacc_up += _shifted(tl.dot(a0, lo, out_dtype=tl.int32), _group_shift(sh_up, 2 * c, G))
            iacc_up += _shifted(tl.dot(a1, hi, out_dtype=tl.int32), _group_shift(sh_up, 2 * c + 1, G))
    gate = iacc.to(tl.float32) * _e8m0(e_ref)[None, :]
    if GATED:
        up = iacc_up.to(tl.float32) * _e8m0(e_ref_up)[None, :]
    else:
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return gate, up


@triton.jit
def _add_groups(acc, d0, d1, s0, s1, sa0, sa1, A_GROUP: tl.constexpr, ROWS: tl.constexpr):
    """acc plus one 64-deep K step's two group dots (d0, d1: exact, fp32) times their weight scales (s0, s1 per
    column), and times their activation scales (sa0, sa1) when those are per group (A_GROUP; else unused): the one
    order of fp32 operations every loop keeps (the kernels agree bit for bit). ROWS: acc, d0, d1 are [rows,
    columns] and sa per row; else [columns] and sa one value."""
    if ROWS:
        s0 = s0[None, :]
        s1 = s1[None, :]
        if A_GROUP:
            sa0 = sa0[:, None]
            sa1 = sa1[:, None]
    if A_GROUP:
        acc = acc + ((d0 * s0) * sa0 + (d1 * s1) * sa1)
    else:
        acc = acc + d0 * s0
        acc = acc + d1 * s1
    return acc


@triton.jit
def _group_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base, offs_n, n_ok,
                N, k_lo, k_hi, stride_bn, stride_bsn, GATED: tl.constexpr, A_GROUP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr, DECODE_ASM: tl.constexpr,
                UNROLL: tl.constexpr = 1):
    """The exact per-group loop over K in [k_lo, k_hi) (all of K, or one split-K share; SPAN = 32: each
    32-deep dot converted to fp32 and scaled by its own group's power of two; SPAN = 64/128: groups merged in
    int32 over the span, `_w4_span`). Returns fp32 (gate, up); the per-row activation scale for A_GROUP = 0 is
    still to be applied. UNROLL (SPAN 32): 64-deep K steps per loop iteration, unrolled, so that their
    independent weight loads can be in flight together; the same operations in the same order (a step past
    k_hi loads nothing and adds zeros)."""
    offs_j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPAN == 32:
        for k_it in range(k_lo, k_hi, 64 * UNROLL):
            for u in tl.static_range(UNROLL):
                k0 = k_it + 64 * u
                if UNROLL > 1:  # a step past k_hi (K not a multiple of the unrolled span) loads nothing: adds 0
                    r_ok = row_ok & (k0 < k_hi)
                    c_ok = n_ok & (k0 < k_hi)
                else:
                    r_ok = row_ok
                    c_ok = n_ok
                a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k0 + offs_j)[None, :]
                a0 = tl.load(a_ptrs, mask=r_ok[:, None], other=0)
                a1 = tl.load(a_ptrs + 32, mask=r_ok[:, None], other=0)
                sa0 = 0.0  # (per-row activation scale: applied after the loop)
                sa1 = 0.0
                if A_GROUP:  # activation scale per (row, group of A_GROUP columns of K; a multiple of 32)
                    sa0 = tl.load(a_scale_ptr + a_rows * a_scale_groups + k0 // A_GROUP, mask=r_ok, other=0.0)
                    sa1 = tl.load(a_scale_ptr + a_rows * a_scale_groups + (k0 + 32) // A_GROUP, mask=r_ok, other=0.0)
                b_ptrs = b_base + _col_base(offs_n, stride_bn)[None, :] + (k0 * 16 + offs_j)[:, None]
                s_ptrs = bs_base + offs_n * stride_bsn + k0 // 32
                d0, d1, s0, s1 = _w4_dots(a0, a1, b_ptrs, s_ptrs, c_ok, DECODE_ASM)
                acc = _add_groups(acc, d0, d1, s0, s1, sa0, sa1, A_GROUP, True)
                if GATED:  # the up rows of the same columns sit N rows further
                    d0, d1, s0, s1 = _w4_dots(a0, a1, b_ptrs + N * stride_bn, s_ptrs + N * stride_bsn, c_ok, DECODE_ASM)
                    acc_up = _add_groups(acc_up, d0, d1, s0, s1, sa0, sa1, A_GROUP, True)
    else:
        for k0 in range(k_lo, k_hi, SPAN):
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k0 + offs_j)[None, :]
            b_ptrs = b_base + _col_base(offs_n, stride_bn)[None, :] + (k0 * 16 + offs_j)[:, None]
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

    return acc, acc_up


@triton.jit
def _glu_quant(acc, acc_up, n_ok, limit, SHIFT: tl.constexpr):
    """The gate-up epilogue: acc = the gate (already halved), acc_up = the up rows (still twice their value);
    the clamped SiLU-GLU, then INT8 per row over these BLOCK_N columns (the scale the down kernel reads per K
    group). Returns (q int8, s fp32 per row)."""
    gate = tl.minimum(acc, limit)
    up = tl.minimum(tl.maximum(acc_up * 0.5, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    h = tl.where(n_ok[None, :], h, 0.0)
    s = tl.max(tl.abs(h), axis=1) / 127.0
    s = tl.where(s > 0, s, 1.0)
    if SHIFT:  # a NaN column (shift map not of these scales) must not vanish in the INT8 rounding
        s = tl.where(tl.max(((acc != acc) | (acc_up != acc_up)).to(tl.int32), axis=1) > 0, float("nan"), s)
    return round_int8(h / s[:, None]), s


@triton.jit
def _glu_finish_kernel(part_ptr, q_ptr, s_ptr, pairs, N, groups, limit,
                       SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K gate-up: the SPLIT_K partial sums of BLOCK_R pair rows and one activation group of BLOCK_N
    columns added in share order (the same order every run), then the epilogue of the unsplit kernel."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    offs_n = g * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = r < pairs
    n_ok = offs_n < N
    ok = r_ok[:, None] & n_ok[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for sk in tl.static_range(SPLIT_K):
        base = part_ptr + (sk * pairs + r[:, None].to(tl.int64)) * (2 * N) + offs_n[None, :]
        acc += tl.load(base, mask=ok, other=0.0)
        acc_up += tl.load(base + N, mask=ok, other=0.0)
    q, s = _glu_quant(acc, acc_up, n_ok, limit, False)
    tl.store(q_ptr + r[:, None].to(tl.int64) * N + offs_n[None, :], q, mask=ok)
    tl.store(s_ptr + r.to(tl.int64) * groups + g, s, mask=r_ok)


@triton.jit
def _w4a8_moe_kernel(
    a_ptr, a_scale_ptr, b_ptr, bs_ptr, c_ptr, c_scale_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_w_ptr, eref_ptr,
    N, K, num_pairs, a_row_div, a_scale_groups, limit,
    stride_am, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, c_scale_groups, stride_ere,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr = 32, DECODE_ASM: tl.constexpr = False,
    SHIFT: tl.constexpr = False, SPLIT_K: tl.constexpr = 1, PAIR_BLOCKS: tl.constexpr = False,
    UNROLL: tl.constexpr = 1, SHIFT_ONLY: tl.constexpr = False,
):
    """SPAN = 32: every scale group converted to fp32 on its own (needed when the activation scale
    changes every 32 columns). SPAN = 64 or 128: groups merged in int32 over the span (`_w4_span`); the
    activation scale, if grouped, is constant over the span (A_GROUP == SPAN).
    SHIFT: eref_ptr is the shift map [E, N (x2 gated: gate rows, then up rows)] (`shift_refs`); a tile whose
    columns are all shiftable runs `_shift_loop` (A_GROUP must then be 0 or a multiple of 64), any other
    the per-group loop. SHIFT_ONLY (with SHIFT): the shift loop alone is compiled, no per-group fallback beside it
    (fewer live registers: the 4-warp 64x128 prefill tile's in-loop spills go, sm_80 census); every tile runs it, and
    a column the map marks unshiftable (0) gives NaN through the shift loop's range check, never a silent number.
    SPLIT_K > 1 (gate-up, per-group loop only): program_id(1) takes one of SPLIT_K equal shares of K (multiples
    of 64) and c_ptr is an fp32 [SPLIT_K, pairs, 2, N] buffer of its (gate, up) partial sums; `_glu_finish_kernel`
    adds the shares in a fixed order (deterministic) and runs the epilogue.
    UNROLL: 64-deep K steps per iteration of the per-group loop (`_group_loop`).
    PAIR_BLOCKS (tiny decode batches): no alignment; M block b is pair b alone (its row 0; the other rows
    padding) and block_expert_ptr is the flattened topk_ids [pairs], its expert; sorted_ids_ptr and
    num_padded_ptr are not read."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if PAIR_BLOCKS:
        ids = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    row_ok = ids < num_pairs
    a_rows = tl.where(row_ok, ids // a_row_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N

    b_base = b_ptr + expert * stride_be
    bs_base = bs_ptr + expert * stride_bse
    if SHIFT:  # the tile's columns (gate and up rows) all shiftable: int32 accumulation, else per group
        er = tl.load(eref_ptr + expert * stride_ere + offs_n, mask=n_ok, other=1).to(tl.int32) & 0xFF
        er_up = er
        tile_ok = tl.min(er, axis=0) > 0
        if GATED:
            er_up = tl.load(eref_ptr + expert * stride_ere + N + offs_n, mask=n_ok, other=1).to(tl.int32) & 0xFF
            tile_ok = tile_ok & (tl.min(er_up, axis=0) > 0)
        if SHIFT_ONLY or tile_ok:
            acc, acc_up = _shift_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base,
                                      offs_n, n_ok, er, er_up, N, K, stride_bn, stride_bsn,
                                      GATED, A_GROUP, BLOCK_M, BLOCK_N, DECODE_ASM)
        else:
            acc, acc_up = _group_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base,
                                      offs_n, n_ok, N, 0, K, stride_bn, stride_bsn,
                                      GATED, A_GROUP, BLOCK_M, BLOCK_N, SPAN, DECODE_ASM, UNROLL)
    elif SPLIT_K > 1:
        k_share = tl.cdiv(K, SPLIT_K * 64) * 64
        k_lo = tl.program_id(1) * k_share
        acc, acc_up = _group_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base,
                                  offs_n, n_ok, N, k_lo, tl.minimum(k_lo + k_share, K), stride_bn, stride_bsn,
                                  GATED, A_GROUP, BLOCK_M, BLOCK_N, SPAN, DECODE_ASM, UNROLL)
    else:
        acc, acc_up = _group_loop(a_ptr, a_scale_ptr, a_rows, row_ok, stride_am, a_scale_groups, b_base, bs_base,
                                  offs_n, n_ok, N, 0, K, stride_bn, stride_bsn,
                                  GATED, A_GROUP, BLOCK_M, BLOCK_N, SPAN, DECODE_ASM, UNROLL)

    _moe_epilogue(acc, acc_up, ids, row_ok, a_rows, offs_n, n_ok, pid_n, a_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr,
                  N, num_pairs, limit, stride_cm, c_scale_groups, GATED, MUL_WEIGHT, A_GROUP, SHIFT, SPLIT_K)


@triton.jit
def _moe_epilogue(acc, acc_up, ids, row_ok, a_rows, offs_n, n_ok, pid_n, a_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr,
                  N, num_pairs, limit, stride_cm, c_scale_groups, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                  A_GROUP: tl.constexpr, SHIFT: tl.constexpr, SPLIT_K: tl.constexpr):
    """An MMA tile's (gate, up) or down sums [BLOCK_M, BLOCK_N] of twice the E2M1 values to its outputs: the per-row
    activation scale (A_GROUP 0), the halving, then split-K partials, or the clamped SiLU-GLU and the intermediate's
    INT8 quantization per BLOCK_N columns (gate-up), or the top-k weight and the pair rows (down)."""
    if not A_GROUP:  # one activation scale per row
        sa = tl.load(a_scale_ptr + a_rows, mask=row_ok, other=0.0)
        acc = acc * sa[:, None]
        acc_up = acc_up * sa[:, None]
    acc = acc * 0.5  # the codes were twice the E2M1 values
    out_rows = tl.where(row_ok, ids, 0).to(tl.int64)
    if GATED and SPLIT_K > 1:  # this share's partial sums; _glu_finish_kernel adds the shares
        part = c_ptr + (tl.program_id(1).to(tl.int64) * num_pairs + out_rows[:, None]) * (2 * N) + offs_n[None, :]
        tl.store(part, acc, mask=row_ok[:, None] & n_ok[None, :])
        tl.store(part + N, acc_up, mask=row_ok[:, None] & n_ok[None, :])
    elif GATED:
        q, s = _glu_quant(acc, acc_up, n_ok, limit, SHIFT)
        tl.store(c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :], q,
                 mask=row_ok[:, None] & n_ok[None, :])
        tl.store(c_scale_ptr + out_rows * c_scale_groups + pid_n, s, mask=row_ok)
    else:
        if MUL_WEIGHT:
            w = tl.load(topk_w_ptr + out_rows, mask=row_ok, other=0.0)
            acc = acc * w[:, None]
        tl.store(c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


# The expanded prefill path (config expand): at large prefill batches every expert's codes are decoded once per call
# into INT8 (shifted: q * 2^(e - e_ref), the shift path's integers) in a transient workspace, and the GEMMs then run
# as plain INT8 grouped GEMMs: the K loop only loads and multiplies (tl.dot on INT8 operands, pipelined), where the
# 4-bit kernel decodes every weight tile again for each M tile of its expert (about 6 times per expert at 16K tokens
# and top-6 over 256 experts). The codes stay 4-bit resident; the workspace holds `expand_mb` of experts at a time.


@triton.jit
def _expand_word_alu(w, m0, m1):
    """One repacked word (8 codes: nibbles 0-3 of the chunk's first scale group, 4-7 of its second) -> two int32
    words of four INT8 each: twice the E2M1 values times m0 (first group) and m1 (second), elementwise (the
    interpreter's form of `_DECODE_SHIFT_ASM`)."""
    lo = tl.zeros(w.shape, dtype=tl.int32)
    hi = tl.zeros(w.shape, dtype=tl.int32)
    for i in tl.static_range(4):
        lo = lo | (((_e2m1x2((w >> (4 * i)) & 0xF) * m0) & 0xFF) << (8 * i))
        hi = hi | (((_e2m1x2((w >> (16 + 4 * i)) & 0xF) * m1) & 0xFF) << (8 * i))
    return lo, hi


@triton.jit
def _expand_kernel(b_ptr, bs_ptr, eref_ptr, w8_ptr, ok_ptr, K, expert_lo, stride_be, stride_bn, stride_bse,
                   stride_bsn, stride_ere, stride_we, stride_wn, stride_oke,
                   BLOCK_N: tl.constexpr, DECODE_ASM: tl.constexpr):
    """Program (expert e_lo + program_id(1), BLOCK_N columns): every K chunk of those columns' codes times 2^(e - e_ref)
    as INT8, written row-major [N, K] into the workspace (w8 [experts, N, K] as int32 words), and ok [experts, N]:
    the column's e_ref where every shift is in 0..3, else 0 (an unshiftable column, or a map not of these scales: the
    GEMM then gives NaN for it, never a number)."""
    e_loc = tl.program_id(1)
    expert = (expert_lo + e_loc).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, 8)
    er = tl.load(eref_ptr + expert * stride_ere + offs_n).to(tl.int32) & 0xFF
    bad = tl.where(er == 0, 1, 0)
    src = (b_ptr + expert * stride_be + _col_base(offs_n, stride_bn)).to(tl.pointer_type(tl.int32))
    s_ptrs = bs_ptr + expert * stride_bse + offs_n * stride_bsn
    dst = (w8_ptr + e_loc.to(tl.int64) * stride_we).to(tl.pointer_type(tl.int32)) \
        + (offs_n.to(tl.int64) * (stride_wn // 4))[None, :] + offs_q[:, None]
    for k0 in range(0, K, 64):
        words = tl.load(src[None, :] + k0 * 4 + offs_q[:, None])  # [8 words, BLOCK_N] of this K chunk
        e0, e1 = _scale_bytes(s_ptrs + k0 // 32, offs_n >= 0)
        d0 = e0 - er
        d1 = e1 - er
        bad = bad | ((d0 | d1) & ~3)
        m0 = 1 << (d0 & 3)
        m1 = 1 << (d1 & 3)
        if DECODE_ASM:
            mul = tl.broadcast_to((m0 | (m1 << 4))[None, :], words.shape)
            lo, hi = tl.inline_asm_elementwise(_DECODE_SHIFT_ASM_C, "=r,=r,r,r", [words, mul],
                                               dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            lo, hi = _expand_word_alu(words, m0[None, :], m1[None, :])
        tl.store(dst + k0 // 4, lo)  # k0 + 4q .. +3
        tl.store(dst + k0 // 4 + 8, hi)  # k0 + 32 + 4q .. +3
    tl.store(ok_ptr + e_loc.to(tl.int64) * stride_oke + offs_n, tl.where(bad == 0, er, 0).to(tl.uint8))


EXPAND_TOKENS = 8192  # default_config's expanded path: above this many tokens a forward at top-6 (49,152 pairs)


def expand_share(e: int, two_i: int, h: int, expand_mb: int = 512) -> tuple[int, int, int]:
    """The expanded path's workspace for `e` experts of gate-up [two_i, h] (the larger of the two weights; down
    [h, two_i / 2] reuses it): (experts per share, bytes of the share's INT8 weights, bytes of its per-row map). A
    transient of the MoE call (torch's caching allocator), allocated only when the expanded path runs."""
    share = max(1, min(e, int(expand_mb) * 2**20 // (two_i * h)))
    return share, share * two_i * h, share * max(two_i, h)


def expand_experts(w, scale, eref, w8, ok, e0: int, n_e: int, decode_asm: bool) -> None:
    """`_expand_kernel` for experts e0 .. e0 + n_e - 1 of one weight (uint8 views of the kernel layout's bytes [E, N,
    K/2], its E8M0 scale bytes [E, N, K/32] and shift map [E, N]) into w8 [>= n_e, N, K] int8 and ok [>= n_e, N]."""
    _expand_kernel[(w8.shape[1] // TILE_COLS, n_e)](
        w, scale, eref, w8, ok, w8.shape[2], e0, w.stride(0), w.stride(1), scale.stride(0), scale.stride(1),
        eref.stride(0), w8.stride(0), w8.stride(1), ok.stride(0), BLOCK_N=TILE_COLS, DECODE_ASM=decode_asm, num_warps=2)


@triton.jit
def _w8_moe_kernel(
    a_ptr, a_scale_ptr, w8_ptr, ok_ptr, c_ptr, c_scale_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    topk_w_ptr, N, K, num_pairs, a_row_div, a_scale_groups, limit, expert_lo, expert_hi,
    stride_am, stride_we, stride_wn, stride_oke, stride_cm, c_scale_groups,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """`_w4a8_moe_kernel`'s shift path on expanded weights (`_expand_kernel`: w8 [experts expert_lo.., N (x2 gated),
    K] INT8, ok the columns' e_ref or 0): the same int32 sums (gate-up over the whole K; down per activation group,
    BLOCK_K = A_GROUP) and the same fp32 steps after them, so the same outputs bit for bit; blocks of experts outside
    [expert_lo, expert_hi) return at once (the workspace holds one share of the experts per launch)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if (expert < expert_lo) | (expert >= expert_hi):
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = ids < num_pairs
    a_rows = tl.where(row_ok, ids // a_row_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    e_loc = expert - expert_lo
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w8_ptr + e_loc * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up = N * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if A_GROUP == 0:  # one activation scale per row: the whole K in int32
        iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        iacc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0)
            iacc = tl.dot(a, tl.load(b_ptrs + k0, mask=n_ok[None, :], other=0), iacc, out_dtype=tl.int32)
            if GATED:
                iacc_up = tl.dot(a, tl.load(b_ptrs + up + k0, mask=n_ok[None, :], other=0), iacc_up,
                                 out_dtype=tl.int32)
        acc = iacc.to(tl.float32)
        acc_up = iacc_up.to(tl.float32)
    else:  # one int32 sum per activation group (BLOCK_K = A_GROUP), converted and scaled as the shift loop does
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0)
            sa = tl.load(a_scale_ptr + a_rows * a_scale_groups + k0 // A_GROUP, mask=row_ok, other=0.0)
            d = tl.dot(a, tl.load(b_ptrs + k0, mask=n_ok[None, :], other=0), out_dtype=tl.int32)
            acc += d.to(tl.float32) * sa[:, None]
            if GATED:
                d = tl.dot(a, tl.load(b_ptrs + up + k0, mask=n_ok[None, :], other=0), out_dtype=tl.int32)
                acc_up += d.to(tl.float32) * sa[:, None]
    ok_base = ok_ptr + e_loc * stride_oke
    er = tl.load(ok_base + offs_n, mask=n_ok, other=1).to(tl.int32) & 0xFF
    acc = tl.where(er[None, :] == 0, float("nan"), acc * _e8m0(er)[None, :])
    if GATED:
        er_up = tl.load(ok_base + N + offs_n, mask=n_ok, other=1).to(tl.int32) & 0xFF
        acc_up = tl.where(er_up[None, :] == 0, float("nan"), acc_up * _e8m0(er_up)[None, :])
    _moe_epilogue(acc, acc_up, ids, row_ok, a_rows, offs_n, n_ok, pid_n, a_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr,
                  N, num_pairs, limit, stride_cm, c_scale_groups, GATED, MUL_WEIGHT, A_GROUP, True, 1)


_DP4A_ASM_C = tl.constexpr("dp4a.s32.s32 $0, $1, $2, $3;")  # four INT8 products summed into int32 (sm_61+)


@triton.jit
def _word_products(words, x_lo, x_hi, DECODE_ASM: tl.constexpr):
    """Per word of the repacked layout (the codes of k0+4q'..k0+4q'+3 as nibbles 0-3 and of k0+32+4q'.. as nibbles
    4-7), the exact int32 dot of its first group's four codes (twice the E2M1 values) with x_lo and of its second
    group's with x_hi (each four INT8 activations in one int32, in k order; broadcastable to words' shape).
    DECODE_ASM: the PRMT decoder (`_DECODE_ASM`, a word in, each group's four INT8 values out; ptxas hoists its table
    constants) and DP4A; else the same integers elementwise (interpreter)."""
    if DECODE_ASM:
        lo, hi = tl.inline_asm_elementwise(_DECODE_ASM_C, "=r,=r,r", [words], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)
        z = tl.zeros(words.shape, dtype=tl.int32)
        p_lo = tl.inline_asm_elementwise(_DP4A_ASM_C, "=r,r,r,r", [lo, tl.broadcast_to(x_lo, words.shape), z],
                                         dtype=tl.int32, is_pure=True, pack=1)
        p_hi = tl.inline_asm_elementwise(_DP4A_ASM_C, "=r,r,r,r", [hi, tl.broadcast_to(x_hi, words.shape), z],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        p_lo = tl.zeros(words.shape, dtype=tl.int32)
        p_hi = tl.zeros(words.shape, dtype=tl.int32)
        for i in tl.static_range(4):  # byte i of the activation word, sign-extended (arithmetic shift of int32)
            p_lo += _e2m1x2((words >> (4 * i)) & 0xF) * ((x_lo << (24 - 8 * i)) >> 24)
            p_hi += _e2m1x2((words >> (16 + 4 * i)) & 0xF) * ((x_hi << (24 - 8 * i)) >> 24)
    return p_lo, p_hi


@triton.jit
def _gemv_dots(words, xw0, xw1, DECODE_ASM: tl.constexpr):
    """Four words per column against a row: words int32 [4, BLOCK_N] (words q..q+3 of each column's K chunk),
    xw0 / xw1 int32 [4, 1]: the row's INT8 activations at the same k for the first and the second scale group.
    Returns each group's exact int32 dot over these 16 + 16 codes [BLOCK_N] (`_word_products` summed over the
    words)."""
    p0, p1 = _word_products(words, xw0, xw1, DECODE_ASM)
    return tl.sum(p0, axis=0), tl.sum(p1, axis=0)


@triton.jit
def _gemv_loads(x_words, a_scale_row_ptr, s_ptrs, wbase, wbase_up, up_s, k0, n_ok, k_hi, GATED: tl.constexpr,
                A_GROUP: tl.constexpr, AHEAD: tl.constexpr):
    """Every load of one 64-deep K step of one row against BLOCK_N columns (`_gemv_dots_step` uses them), as a
    tuple: the row's INT8 activation words (x_words: int32 pointer; words k0/4 .. +3, +8, +4, +12, in the order
    the dots take them), its activation scales when per group (else 0.0), and the gate's and (GATED) the up rows'
    codes and scale word: wbase [BLOCK_N] int32 pointers to each column's first K chunk, whose 8 words (32 bytes)
    per step are read as two 4-word halves [4, BLOCK_N], so that with one column per thread (BLOCK_N = 32 x warps)
    every sum over words stays in its thread; s_ptrs each column's first scale byte, up rows up_s further. Columns
    past n_ok read as 0; AHEAD (a prefetching loop's step, which may lie at or past k_hi): such a step reads 0."""
    xa = x_words + k0 // 4 + tl.arange(0, 4)
    live = k0 < k_hi
    ok = n_ok
    if AHEAD:
        ok = n_ok & live
        xs = (tl.load(xa, mask=live, other=0), tl.load(xa + 8, mask=live, other=0),
              tl.load(xa + 4, mask=live, other=0), tl.load(xa + 12, mask=live, other=0))
    else:
        xs = (tl.load(xa), tl.load(xa + 8), tl.load(xa + 4), tl.load(xa + 12))
    sa0 = 0.0  # (per-row activation scale: applied after the loop)
    sa1 = 0.0
    if A_GROUP:  # activation scale per group of A_GROUP columns of K
        if AHEAD:
            sa0 = tl.load(a_scale_row_ptr + k0 // A_GROUP, mask=live, other=0.0)
            sa1 = tl.load(a_scale_row_ptr + (k0 + 32) // A_GROUP, mask=live, other=0.0)
        else:
            sa0 = tl.load(a_scale_row_ptr + k0 // A_GROUP)
            sa1 = tl.load(a_scale_row_ptr + (k0 + 32) // A_GROUP)
    gate = _gemv_column_loads(wbase, s_ptrs, k0, ok)
    up = gate
    if GATED:  # the up rows of the same columns sit N rows further
        up = _gemv_column_loads(wbase_up, s_ptrs + up_s, k0, ok)
    return xs, sa0, sa1, gate, up


@triton.jit
def _gemv_column_loads(wbase, s_ptrs, k0, ok):
    """One K step's codes of BLOCK_N columns as (first half, second half) [4, BLOCK_N] int32 and their scale word
    (`_gemv_loads`)."""
    w_ptrs = wbase[None, :] + (k0 * 4 + tl.arange(0, 4))[:, None]
    return (tl.load(w_ptrs, mask=ok[None, :], other=0), tl.load(w_ptrs + 4, mask=ok[None, :], other=0),
            _scale_word(s_ptrs + k0 // 32, ok))


@triton.jit
def _gemv_dots_step(acc, xs, sa0, sa1, w, A_GROUP: tl.constexpr, DECODE_ASM: tl.constexpr):
    """acc plus one K step from its loads (`_gemv_loads`; w: a (first half, second half, scale word) of the gate
    or the up rows): the two scale groups' exact int32 dots, scaled in `_add_groups`' order."""
    a0, a1 = _gemv_dots(w[0], xs[0][:, None], xs[1][:, None], DECODE_ASM)
    b0, b1 = _gemv_dots(w[1], xs[2][:, None], xs[3][:, None], DECODE_ASM)
    s0, s1 = _word_scales(w[2])
    return _add_groups(acc, (a0 + b0).to(tl.float32), (a1 + b1).to(tl.float32), s0, s1, sa0, sa1, A_GROUP, False)


@triton.jit
def _gemv_step(acc, acc_up, loads, GATED: tl.constexpr, A_GROUP: tl.constexpr, DECODE_ASM: tl.constexpr):
    """(acc, acc_up) plus one K step from its `_gemv_loads`: the gate, then (GATED) the up rows."""
    xs, sa0, sa1, gate, up = loads
    acc = _gemv_dots_step(acc, xs, sa0, sa1, gate, A_GROUP, DECODE_ASM)
    if GATED:
        acc_up = _gemv_dots_step(acc_up, xs, sa0, sa1, up, A_GROUP, DECODE_ASM)
    return acc, acc_up


@triton.jit
def _gemv_group_loop(a_row_ptr, a_scale_row_ptr, b_base, bs_base, offs_n, n_ok, N, k_lo, k_hi, stride_bn,
                     stride_bsn, GATED: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                     DECODE_ASM: tl.constexpr, PREFETCH: tl.constexpr = 0):
    """`_group_loop` for one row (pair blocks' single real row) on CUDA cores: the same exact int32 dots per
    32-deep group and the same fp32 scaling and accumulation, in the same order (bit-equal to it in the
    interpreter). PREFETCH (1 or 2): every load of the step that many steps ahead is issued in this one, carried
    in registers: the loop has no tl.dot, so Triton does not pipeline it, and ptxas issues a step's loads next to
    the DP4As that use them; at one token the warps wait on them (H200 profile, session 19: 4.5-5.3 cycles of
    long-scoreboard stall per issued instruction, 18-22 % of issue slots used). Returns fp32 (gate, up)."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_words = a_row_ptr.to(tl.pointer_type(tl.int32))
    wbase = (b_base + _col_base(offs_n, stride_bn)).to(tl.pointer_type(tl.int32))
    wbase_up = (b_base + N * stride_bn + _col_base(offs_n, stride_bn)).to(tl.pointer_type(tl.int32))
    s_ptrs = bs_base + offs_n * stride_bsn
    up_s = N * stride_bsn
    if PREFETCH:
        cur = _gemv_loads(x_words, a_scale_row_ptr, s_ptrs, wbase, wbase_up, up_s, k_lo, n_ok, k_hi,
                          GATED, A_GROUP, True)
        if PREFETCH == 2:
            nxt = _gemv_loads(x_words, a_scale_row_ptr, s_ptrs, wbase, wbase_up, up_s, k_lo + 64, n_ok, k_hi,
                              GATED, A_GROUP, True)
        for k0 in range(k_lo, k_hi, 64):
            ahead = _gemv_loads(x_words, a_scale_row_ptr, s_ptrs, wbase, wbase_up, up_s, k0 + 64 * PREFETCH, n_ok,
                                k_hi, GATED, A_GROUP, True)
            acc, acc_up = _gemv_step(acc, acc_up, cur, GATED, A_GROUP, DECODE_ASM)
            if PREFETCH == 2:
                cur = nxt
                nxt = ahead
            else:
                cur = ahead
    else:
        for k0 in range(k_lo, k_hi, 64):
            loads = _gemv_loads(x_words, a_scale_row_ptr, s_ptrs, wbase, wbase_up, up_s, k0, n_ok, k_hi, GATED,
                                A_GROUP, False)
            acc, acc_up = _gemv_step(acc, acc_up, loads, GATED, A_GROUP, DECODE_ASM)
    return acc, acc_up


@triton.jit
def _pair_tile(expert_ptr, N, a_row_div, BLOCK_N: tl.constexpr):
    """A pair-block program's (pair, BLOCK_N-column tile) from its program id: the pair p, the tile's index, the
    pair's expert (int64; < 0: nothing to do), its activation row (p // a_row_div) and the tile's columns."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    p = pid // n_tiles
    pid_n = pid % n_tiles
    expert = tl.load(expert_ptr + p).to(tl.int64)
    return p, pid_n, expert, (p // a_row_div).to(tl.int64), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _w4a8_gemv_kernel(
    a_ptr, a_scale_ptr, b_ptr, bs_ptr, c_ptr, c_scale_ptr, expert_ptr, topk_w_ptr,
    N, K, num_pairs, a_row_div, a_scale_groups, limit,
    stride_am, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, c_scale_groups,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE_ASM: tl.constexpr = False, SPLIT_K: tl.constexpr = 1, PREFETCH: tl.constexpr = 0,
):
    """`_w4a8_moe_kernel` with PAIR_BLOCKS for tiny decode batches, without the MMA: program (pair, column tile[,
    K share]) multiplies its pair's one row on CUDA cores (`_gemv_group_loop`). The MMA kernel computes 16 tile
    rows for one real one (every group's I2F and FFMA on all 16); this one decodes each code once and
    multiplies it once (DP4A). Same outputs, same epilogues (split-K partials, the GLU and INT8 quantization of
    the intermediate per BLOCK_N columns, the top-k weight)."""
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
    acc, acc_up = _gemv_group_loop(a_ptr + row * stride_am, a_scale_ptr + row * a_scale_groups,
                                   b_ptr + expert * stride_be, bs_ptr + expert * stride_bse, offs_n, n_ok, N,
                                   k_lo, k_hi, stride_bn, stride_bsn, GATED, A_GROUP, BLOCK_N, DECODE_ASM,
                                   PREFETCH)
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


# The wide one-token path (config wide; session 29): every load of a program issued at once. At one token the two
# GEMM launches of the MMA tile and of gemv moved their 12.6 + 6.3 MB at 1.0-1.3 TB/s (sessions 19-20: the MMA tile
# issue-bound on its 15 padding rows, gemv's few warps waiting on each K step's loads in turn), and three small
# launches (split-K finish, top-k sum, quantizer) came on top. Here a gate-up program holds its pair's whole K for
# BLOCK_N columns of the gate and the up rows (no split-K, so no finish launch; the GLU and the intermediate's INT8
# rounding in its epilogue), its codes loaded as one [K/64, BLOCK_N, 8]-word tensor per side (the tile-major layout
# makes each chunk's BLOCK_N columns one contiguous block), the K reduction done across the program's threads; a
# down program holds BLOCK_N2 output columns of one token for all of its TOP_K pairs and adds them in pair order,
# times the router weight and the routed scaling (no top-k sum launch). The same exact int32 group dots as every
# other loop; the fp32 sums run in another order (a tree over K), so outputs agree with the other configs to fp32
# rounding, not bit for bit.
@triton.jit
def _wide_codes(w_rows, offs_n, K: tl.constexpr):
    """The codes of R chunk rows against BLOCK_N columns offs_n (16, or a multiple of 32, aligned to itself), as one
    [R, BLOCK_N, 8]-word tensor: w_rows [R] int32 pointers to each row's 64-deep K chunk block (in the tile-major
    layout column n's chunk is 32 bytes at (n // 32) * 16K + (n % 32) * 32 from it, so the BLOCK_N columns' words
    are one contiguous block). Unmasked: a row that must add nothing (padding past K, a missing pair) points at valid
    codes and its scales read as 0 (`_wide_rows`); a masked load took a zeroing instruction per register and kept
    the activation words' copies apart (session 29's sm_80 build of the down launch)."""
    offs_w = tl.arange(0, 8)
    col = (offs_n // 32) * (K * 4) + (offs_n % 32) * 8  # in words: a 32-row tile is 32 * K/2 bytes
    return tl.load(w_rows[:, None, None] + col[None, :, None] + offs_w[None, None, :])


@triton.jit
def _wide_x(x_rows, offs_n):
    """The INT8 activation words the codes of `_wide_codes` multiply, in their shape and layout: x_rows [R] int32
    pointers to the activation row's words at each row's chunk; word q of a chunk pairs with x words q (k = 4q..,
    the first scale group) and 8 + q (k = 32 + 4q.., the second). Addressed per element like the codes, so that
    they share the codes' layout (loaded as [R, 1, 8] and broadcast, they took a layout of their own and Triton moved
    the decoded codes to it through shared memory); the copies along the columns are one load each after CSE."""
    xw = x_rows[:, None, None] + tl.arange(0, 8)[None, None, :] + 0 * offs_n[None, :, None]
    return tl.load(xw), tl.load(xw + 8)


@triton.jit
def _wide_rows(words, x_lo, x_hi, s_rows, sa_rows, k_rows, ok, offs_n, stride_bsn, A_GROUP: tl.constexpr,
               DECODE_ASM: tl.constexpr):
    """R chunk rows of a wide program (`_wide_codes`, `_wide_x`) against BLOCK_N columns: fp32 [R, BLOCK_N], per row
    its two scale groups' exact int32 dots times their weight scales (s_rows [R]: each row's scale bytes, column n's
    pair n * stride_bsn further) and, A_GROUP, their activation scales (sa_rows [R] fp32 pointers to the activation
    row's scales, k_rows [R] the chunk's K offset); the per-row scale of A_GROUP 0 is the caller's. Rows where ok [R]
    is false read their scales as 0 and add exactly 0 (their codes and activations are valid memory, not masked)."""
    ok2 = ok[:, None]
    s0, s1 = _word_scales(_scale_word(s_rows[:, None] + offs_n[None, :] * stride_bsn, ok2))
    p_lo, p_hi = _word_products(words, x_lo, x_hi, DECODE_ASM)
    if A_GROUP == 16:  # two activation groups per weight group: words 0-3 and 4-7, each half's int32 dot by itself
        first = (tl.arange(0, 8) < 4)[None, None, :]
        sa = sa_rows[:, None] + k_rows[:, None] // 16  # the chunk's four groups: lo 0, 1; hi 2, 3
        v = (tl.sum(tl.where(first, p_lo, 0), axis=2).to(tl.float32) * tl.load(sa, mask=ok2, other=0.0)
             + tl.sum(tl.where(first, 0, p_lo), axis=2).to(tl.float32) * tl.load(sa + 1, mask=ok2, other=0.0)) * s0 \
            + (tl.sum(tl.where(first, p_hi, 0), axis=2).to(tl.float32) * tl.load(sa + 2, mask=ok2, other=0.0)
               + tl.sum(tl.where(first, 0, p_hi), axis=2).to(tl.float32) * tl.load(sa + 3, mask=ok2, other=0.0)) * s1
    elif A_GROUP:
        sa_lo = tl.load(sa_rows[:, None] + k_rows[:, None] // A_GROUP, mask=ok2, other=0.0)
        sa_hi = tl.load(sa_rows[:, None] + (k_rows[:, None] + 32) // A_GROUP, mask=ok2, other=0.0)
        v = (tl.sum(p_lo, axis=2).to(tl.float32) * s0) * sa_lo + (tl.sum(p_hi, axis=2).to(tl.float32) * s1) * sa_hi
    else:
        v = tl.sum(p_lo, axis=2).to(tl.float32) * s0 + tl.sum(p_hi, axis=2).to(tl.float32) * s1
    return v


@triton.jit
def _wide_gate_up_kernel(
    a_ptr, a_scale_ptr, b_ptr, bs_ptr, q_ptr, q_scale_ptr, expert_ptr,
    N, a_row_div, a_scale_groups, limit, stride_am, stride_be, stride_bse, stride_bsn, stride_qm, q_groups,
    K: tl.constexpr, C: tl.constexpr, A_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, DECODE_ASM: tl.constexpr,
    QUANT: tl.constexpr = False, xq_ptr=None,
):
    """Program (pair, BLOCK_N columns): the gate and the up rows of those columns over the pair's whole K (C: K/64
    rounded up to a power of two; chunks past K/64 read the last chunk's memory and add 0: their scales read 0), then the clamped SiLU-GLU and the intermediate's INT8
    rounding per BLOCK_N columns (`_glu_quant`), stored as the down launch reads them. N (the intermediate) a
    multiple of BLOCK_N, K (hidden) of 64. Every code load is issued at once.
    QUANT (A_GROUP 0): no quantizer launch before this one: a_ptr is the layer input (BF16 rows, stride_am), and each
    program first rounds its token's row to INT8 itself with `_quantize_rows_kernel`'s operations (the same q and s)
    into its own scratch row xq_ptr + pid * 64C, then (after a barrier) loads the codes and reads the words back in
    their layout; a_scale_ptr is not read. (Done after the code loads were issued, the row held the codes' registers
    longer: 11.4 us at one token on the H200 against 8.4 for the plain launch and 2.1 for the quantizer's.)"""
    p, pid_n, expert, row, offs_n = _pair_tile(expert_ptr, N, a_row_div, BLOCK_N)
    if expert < 0:
        return
    pid = tl.program_id(0)
    offs_c = tl.arange(0, C)
    ok = offs_c < K // 64
    c_at = tl.minimum(offs_c, K // 64 - 1)  # (padded chunks read the last one's memory; their scales read as 0)
    w_rows = (b_ptr + expert * stride_be).to(tl.pointer_type(tl.int32)) + c_at * 256
    s_rows = bs_ptr + expert * stride_bse + 2 * offs_c
    sa_row = a_scale_ptr + row * a_scale_groups
    if QUANT:  # the token's row rounded to INT8 here (one scale per token), into this program's scratch row
        offs_k = tl.arange(0, 64 * C)
        xv = tl.load(a_ptr + row * stride_am + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        sa = _int8_scale(tl.max(tl.abs(xv), axis=0))
        scratch = xq_ptr + pid.to(tl.int64) * (64 * C)
        tl.store(scratch + offs_k, round_int8(tl.math.div_rn(xv, sa)))
        tl.debug_barrier()  # each thread reads words the others wrote
        x_words = scratch.to(tl.pointer_type(tl.int32))
    else:
        x_words = (a_ptr + row * stride_am).to(tl.pointer_type(tl.int32))
    gate_w = _wide_codes(w_rows, offs_n, K)
    up_w = _wide_codes(w_rows + N * (K // 8), offs_n, K)  # the up rows sit N rows further
    x_lo, x_hi = _wide_x(x_words + 16 * c_at, offs_n)
    sa_rows = sa_row + 0 * offs_c
    gate = tl.sum(_wide_rows(gate_w, x_lo, x_hi, s_rows, sa_rows, 64 * offs_c, ok, offs_n, stride_bsn, A_GROUP,
                             DECODE_ASM), axis=0)
    up = tl.sum(_wide_rows(up_w, x_lo, x_hi, s_rows + N * stride_bsn, sa_rows, 64 * offs_c, ok, offs_n, stride_bsn,
                           A_GROUP, DECODE_ASM), axis=0)
    if not A_GROUP:
        if not QUANT:
            sa = tl.load(sa_row)
        gate = gate * sa
        up = up * sa
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
    TOP_K pairs or K/64 chunks, or of expert -1, read valid memory and add 0: their scales and weights read 0), each row times 1/2 (the codes are twice the E2M1 values) and its pair's
    router weight, summed, times the routed scaling, cast to out's dtype. A pair of expert -1 adds nothing. N
    (hidden) a multiple of BLOCK_N. (Loading every pair's rows in one tensor puts all of them in flight together; a
    loop over the pairs waited on each pair's expert id and codes in turn: 10.0 us at one token on the H200 against
    the MMA down launch's 6.5, session 29.)"""
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


def default_config(pairs: int, inter: int = 512, expand_ok: bool = False) -> dict:
    """Tile sizes and the shift path by the number of (token, expert) pairs, from the H200 benches of sessions
    7 and 8 (docs/moe.md; to be re-tuned on an A800). block_n is also the intermediate's INT8 group (a multiple
    of 32). Decode (up to 64 tokens at top-6): the 16x32 tile, per-group scaling (the shift path was 1.4x
    slower there: 84 vs 60 us at one token); from 5 tokens on, 2 warps, a 128-wide down tile and 4 stages
    (session 8's decode sweep: 199 / 353 us at 16 / 64 tokens against 219 / 419 with 4 warps and the 64-wide
    down tile; at one token 4 warps stay faster, 55 against 61 us; between 1 and 16 tokens the switch point
    is not measured); (until session 22) up to 4096 pairs 32x128 per group, beyond 64x128 with 4 warps and the
    shift path (1.7x faster than per-group in that tile, 3x faster than session 4's 64x64 tile). Decode also takes
    fused_io (one launch for the activation quantizer, one for the top-k combine, instead of ~15 small torch
    kernels): session 11's H200 sweep, CUDA-graph replays, 52 -> 32 us at 1 token, 98 -> 66 at 4, 188 -> 143 at
    16, 345 -> 303 at 64 (prefill since session 22, below). Up to 4 tokens also
    pair_blocks (no alignment launches) and split_k 4 (gate-up K in 4 shares): session 15's sweep at TP4 shapes,
    33.5 -> 21.4 us at 1 token, 69.0 -> 60.1 at 4 (w4a8_moe lowers split_k where the hidden size needs it).
    From 2 to 32 tokens gemv (the pair's row on CUDA cores, split_k 8): session 19's H200 sweep at TP4 shapes,
    CUDA-graph replays, against the MMA configs it replaced: 39.4 -> 35.4 us at 2 tokens, 61.0 -> 43.5 at 4,
    96.8 -> 76.2 at 8, 150.4 -> 120.4 at 16, 193.4 -> 164.8 at 24, 231.4 -> 211.2 at 32; at 48 and 64 tokens the
    MMA tile wins (282.8 / 323.7 against 302.1 / 401.7), and at one token (25.0 against 29.3). inter, the expert
    intermediate width per rank: at TP1 full width (2048) the aligned MMA tile already wins at 32 tokens (870.6 against
    gemv's 1119.1 us; 16 tokens even, 547.2 / 550.0; 4 tokens gemv 125.4 against 182.0), so above 512 gemv stops at
    16 tokens (1024, TP2, is not measured). gemv_prefetch 1 with the 128-wide down tile: session 20's H200 sweep
    (TP4 shapes), against the gemv config above: 33.2 -> 29.7 us at 2 tokens, 42.6 -> 41.0 at 4, 77.3 -> 71.2 at 8,
    118.9 -> 113.5 at 16, 207.8 -> 200.9 at 32; at one token 24.7 against the MMA tile's 24.4-24.6, which stays
    (prefetch 2: 25.2 / 31.3 / 45.3 / 70.9 / 118.9 / 210.4 at 1 / 2 / 4 / 8 / 16 / 32, ahead of 1 only at 8).
    The 33-64-token tile (16x32, 2 warps, down 128, 4 stages, fused io) also from 65 to 512 tokens (3072 pairs):
    session 21's H200 sweep at 512 tokens (TP4 shapes, CUDA-graph replays, one process) had it at 553 us against
    763 for the 32x128 tile it replaced (698 with fused io added; Marlin 497 in that session's other run); the
    block_m-16 tile spreads the ~12 rows an expert gets at 512 tokens over no padding rows. Between 65 and 511
    tokens neither tile is timed (both ends favour this one).
    Session 22's H200 runs with mma.sync only (DISABLE_MMA_V3=1: the instruction an A800 has; Triton otherwise takes
    wgmma on an H200 for the 64-row tiles), SGLang's alignment, Marlin in the same runs (docs/moe.md): 513-768 tokens
    the same tile with pair_bf16 (the per-pair outputs in BF16, as Marlin keeps them): 498 / 640 us at 600 / 768
    tokens against Marlin's 561 / 633, where the 64x128 tile took 735 / 740 (session 23: to 682 tokens, below). From
    769 tokens (session 23: from 1,281) the 64x128 tile with the
    shift path, fused io and pair_bf16: 751 / 1,521 / 2,620 / 4,847 us at 1,024 / 4,096 / 8,192 / 16,384 tokens
    against the 32x128 / 64x128 tiles without them, 893 / 2,063 / - / 6,870 (Marlin 687 / 2,091 / 3,687 / 6,958; the
    16x32 tile 777 at 1,024): at prefill sizes the torch quantizer and the fp32 [pairs, H] buffer's top-k sum cost
    ~2 ms of 6.9 at 16K tokens. Above 8192 tokens (49,152 pairs) and
    expand_ok (the caller's word that every column of both shift maps is shiftable; `dsv4_sm80/stages/moe.py` reads it from
    the maps at load), config expand (the experts decoded once per call into an INT8 workspace, then plain INT8
    GEMMs): 4,110 us at 16K tokens (0.59x Marlin's time), but 1,933 at 4,096 against 1,521 (the decode of every
    expert, ~1.2 ms, is a fixed cost; the two lines cross near 8,900 tokens by those two points; 8,192 untimed).
    Session 23's H200 runs (mma.sync only, Marlin in the same process): from 683 to 1,280 tokens a 32x64 tile with
    2 warps, 4 stages, the shift path, fused io and pair_bf16 (~16-30 rows an expert: one 32-row tile, twice the
    programs along N of the 128-wide tile): 552 / 556 / 604 / 637 / 729 us at 768 / 896 / 1,024 / 1,152 / 1,280
    tokens against the 64x128 tile's 643 (16x32) / 742 / 749 / 751 / 755 and Marlin's 641 / 656 / 688 / 751 / 824;
    at 640 tokens the 16x32 tile stays (529 against 546), at 1,536 the 64x128 (770 against 928). As defaults: 0.86 /
    0.87 / 0.88 / 0.90 / 0.89x Marlin's time at 640 / 768 / 1,024 / 1,280 / 1,536 tokens.
    One token (session 29): config wide, 32 columns x 16 warps per gate-up program with the input's INT8 rounding in
    it, 16 output columns x 8 warps per down program: 16.5-16.9 us on the H200 at TP4 shapes (CUDA-graph replays, fresh
    routings) against the pair-block MMA tile's 24.7-25.0 (which stays as the fallback at one token: the keys above); the
    same intermediate group (32) as every other decode config. (16 x 8 warps for the gate-up, group 16, took 16.7.)"""
    if pairs <= 6:  # one token: the wide path (its own two launches; the MMA tile's keys if it yields, e.g. to input_group)
        return {"block_m": 16, "block_n": 32, "block_n2": 64, "num_warps": 4, "num_stages": 3, "shift": False,
                "fused_io": True, "pair_blocks": True, "split_k": 4,
                "wide": True, "wide_n": 32, "wide_warps": 16, "wide_n2": 16, "wide_warps2": 8, "wide_quant": True}
    if pairs <= (192 if inter <= 512 else 96):  # 2-32 tokens (2-16 for a wider intermediate): gemv, K in 8 shares
        return {"block_m": 16, "block_n": 32, "block_n2": 128, "num_warps": 4, "num_stages": 3, "shift": False,
                "fused_io": True, "pair_blocks": True, "gemv": True, "split_k": 8, "gemv_prefetch": 1}
    if pairs <= 4096:  # decode and short prefill (to 682 tokens): few rows per expert, parallelism from N
        return {"block_m": 16, "block_n": 32, "block_n2": 128, "num_warps": 2, "num_stages": 4, "shift": False,
                "fused_io": True, "pair_bf16": pairs > 3072}
    if pairs <= 7680:  # 683-1280 tokens (~16-30 rows an expert): 32 rows, 64 wide, 2 warps, 4 stages (session 23)
        return {"block_m": 32, "block_n": 64, "block_n2": 128, "num_warps": 2, "num_stages": 4, "shift": True,
                "fused_io": True, "pair_bf16": True}
    prefill = {"block_m": 64, "block_n": 128, "block_n2": 128, "num_warps": 4, "num_stages": 3, "shift": True,
               "fused_io": True, "pair_bf16": True}
    if pairs > 6 * EXPAND_TOKENS and expand_ok:  # above 8192 tokens, every column of the layer shiftable: expanded
        return dict(prefill, expand=True)
    return prefill


CONFIG_KEYS = frozenset({  # every option `w4a8_moe` reads from its config (`default_config` sets a subset)
    "block_m", "block_n", "block_n2", "num_warps", "num_stages", "shift", "fused_io", "pair_blocks", "split_k", "gemv",
    "gemv_n", "gemv_prefetch", "merge", "unroll", "unroll_down", "pair_bf16", "decode", "shift_only", "expand",
    "block_k", "expand_mb", "wide", "wide_n", "wide_n2", "wide_warps", "wide_warps2", "wide_quant"})


WIDE_OWN = frozenset({"wide", "wide_n", "wide_n2", "wide_warps", "wide_warps2", "wide_quant", "decode", "fused_io"})


def takes_wide(asked: dict, cfg: dict, h: int, inter: int) -> bool:
    """Whether `w4a8_moe` runs the wide path for a call whose config asked for `asked` (cfg: default_config's merged
    with it): when asked for, or when default_config chose it and nothing of another kernel was asked for (a tile, a
    loop: the caller means that kernel) and its widths tile hidden h and intermediate inter."""
    if "wide" in asked:
        return bool(asked["wide"])
    return bool(cfg.get("wide", False)) and not (set(asked) - WIDE_OWN or inter % int(cfg.get("wide_n", 16))
                                                 or h % int(cfg.get("wide_n2", 16)))


def _wide_width(name: str, width: int, dim: int, dim_name: str) -> None:
    if not (width == 16 or width % 32 == 0) or dim % width:
        raise ValueError(f"w4a8_moe config {name}={width}: 16 or a multiple of 32 that divides {dim_name} {dim}")


def _wide_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, cfg, swiglu_limit, routed_scaling_factor,
              input_group, out):
    """config wide: `_wide_gate_up_kernel` (pair, wide_n columns; wide_warps) and `_wide_down_kernel` (token, wide_n2
    output columns; wide_warps2), with wide_quant the input's INT8 rounding inside the first (else the quantizer
    launch before them): two launches (three), no alignment, split-K finish or top-k sum. The intermediate's INT8
    group is wide_n columns."""
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    pairs = t * top_k
    wn, wn2 = int(cfg.get("wide_n", 16)), int(cfg.get("wide_n2", 16))
    _wide_width("wide_n", wn, inter, "intermediate")
    _wide_width("wide_n2", wn2, h, "hidden")
    dev = x.device
    decode_asm = cfg.get("decode", "asm" if x.is_cuda and not _INTERPRETED else "alu") == "asm"
    res = out if out is not None and out.is_contiguous() else torch.empty((t, h), dtype=x.dtype, device=dev)
    if not t:
        return res if out is None or res is out else out.copy_(res)
    quant = bool(cfg.get("wide_quant", False))  # the input's rounding inside the gate-up launch
    if quant and input_group:
        raise ValueError(f"w4a8_moe config wide_quant: one scale per token only (input_group 0, not {input_group})")
    c_up = triton.next_power_of_2(h // CHUNK)
    groups = inter // wn  # the intermediate's INT8 groups a pair, one per gate-up program
    hq = torch.empty((pairs, inter), dtype=torch.int8, device=dev)
    hs = torch.empty((pairs, groups), dtype=torch.float32, device=dev)
    scratch = None
    if quant:  # (the input's scales are not read: hs stands in for the argument)
        xq, xs = (x if x.stride(1) == 1 else x.contiguous()), hs
        scratch = torch.empty((pairs * groups, 64 * c_up), dtype=torch.int8, device=dev)  # a row per program
    else:
        xq, xs = quantize_rows_int8_fused(x, input_group)
    ids = topk_ids.reshape(-1).contiguous()
    w13b, w13s = w13.view(torch.uint8), w13_scale.view(torch.uint8)
    w2b, w2s = w2.view(torch.uint8), w2_scale.view(torch.uint8)
    _wide_gate_up_kernel[(pairs * groups,)](
        xq, xs, w13b, w13s, hq, hs, ids, inter, top_k, xs.shape[1], float(swiglu_limit), xq.stride(0),
        w13b.stride(0), w13s.stride(0), w13s.stride(1), hq.stride(0), groups,
        K=h, C=c_up, A_GROUP=input_group, BLOCK_N=wn, DECODE_ASM=decode_asm, QUANT=quant, xq_ptr=scratch,
        num_warps=int(cfg.get("wide_warps", 8)))
    _wide_down_kernel[(t * (h // wn2),)](
        hq, hs, w2b, w2s, res, ids, topk_weights.reshape(-1).to(torch.float32).contiguous(), h, groups,
        float(routed_scaling_factor), hq.stride(0), w2b.stride(0), w2s.stride(0), w2s.stride(1), res.stride(0),
        K=inter, C=triton.next_power_of_2(inter // CHUNK), TOP_K=top_k, TOP_K_P=triton.next_power_of_2(top_k),
        A_GROUP=wn, BLOCK_N=wn2,
        DECODE_ASM=decode_asm, num_warps=int(cfg.get("wide_warps2", 8)))
    return res if out is None or res is out else out.copy_(res)


def w4a8_moe(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, swiglu_limit: float = 10.0,
    routed_scaling_factor: float = 1.0, input_group: int = 0, config: dict | None = None,
    out: torch.Tensor | None = None, w13_eref: torch.Tensor | None = None, w2_eref: torch.Tensor | None = None,
    expand_ok: bool = False,
) -> torch.Tensor:
    """The routed-expert output for x [T, H] (bf16): sum_k w_k * down_e(act(gate_up_e(x))) * scaling.

    w13 [E, 2I, H/2] and w2 [E, H, I/2]: MXFP4 bytes in the kernel layout (repack_mxfp4_for_w4a8);
    scales [E, 2I, H/32], [E, H, I/32]: E8M0 (float8_e8m0fnu or uint8). topk_* [T, top_k].
    w13_eref [E, 2I], w2_eref [E, H]: the shift maps of those scales (`shift_refs`, computed once at load);
    config pair_bf16 (default off): the per-pair outputs kept in BF16 before the fp32 top-k sum (Marlin's way; half
    the traffic of the largest prefill buffer). config fused_io (default_config: decode sizes): one launch each for
    the activation quantizer and the top-k combine.
    config pair_blocks (default off): no sorting by expert (SGLang's moe_align_block_size: two launches); each
    (token, expert) pair is its own M block, its row 0, the rest padding: for tiny decode batches, where a
    block holds one pair anyway and the alignment is a fixed cost (a repeated expert is read once per pair).
    config unroll (per-group loop; default 1): that many 64-deep K steps per loop iteration, unrolled (the same
    operations in the same order), so more independent weight loads can be in flight per program (session 15:
    no gain with split-K; session 19's profile found the one-token MMA launches issue-bound, not load-bound).
    config gemv (with pair_blocks; default_config: 2-32 tokens, 2-16 above 512 intermediate per rank; yields to
    merge, shift, unroll or pair_blocks off asked for): each pair's one row multiplied on CUDA cores (PRMT decode, DP4A
    per four codes; `_w4a8_gemv_kernel`) instead of a 16-row INT8 MMA tile whose 15 padding rows still take every
    group's conversion and scaling; the same integers and fp32 steps (bit-equal in the interpreter). One column
    per thread: the gate-up tile is gemv_n columns (default 128) with split-K, block_n without; the down tile
    block_n2; warps = tile / 32. gemv_prefetch (0, 1, 2; default_config 1, else 0): each K step's loads issued
    that many steps ahead, carried in registers (Triton does not pipeline a loop without tl.dot).
    config split_k (gate-up, per-group loop; default 1): K in that many shares, each its own program, their
    fp32 partial sums added in a fixed order by `_glu_finish_kernel` (deterministic): more programs when few
    experts are active (one token: 6 experts x 16 column tiles = 96 programs for the whole GPU).
    config shift_only (default off; with the shift path in both launches): the shift loop alone, no per-group
    fallback compiled beside it (sm_80 census, 64x128 tile, 4 warps: the loop's spills go); a tile with an unshiftable
    column then gives NaN (the loop's range check), so it is for layers whose maps are all shiftable.
    config expand (default_config: above 8192 tokens with expand_ok, the caller's word that every column of both shift
    maps is shiftable): the experts' codes decoded once per call into a transient INT8 workspace, expand_mb (default
    512) MiB of experts at a time, then plain INT8 grouped GEMMs with K steps of block_k (gate-up, default 128; the
    input group when there is one) and block_n (down); bit-equal to the shift loop, NaN where a column is not shiftable.
    With the shift maps and config shift (`default_config` sets it for prefill only), tiles whose columns are all
    shiftable accumulate in int32
    (`_shift_loop`); without them, or for a launch whose activation group is not a multiple of 64 (the
    down kernel when block_n is 32), every tile runs the per-group loop."""
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    asked = config or {}
    unknown = set(asked) - CONFIG_KEYS
    if unknown:  # a misspelt or retired option would otherwise time or test the default instead, silently
        raise ValueError(f"w4a8_moe config: unknown option(s) {sorted(unknown)}; known: {sorted(CONFIG_KEYS)}")
    cfg = dict(default_config(t * top_k, inter, expand_ok and w13_eref is not None and w2_eref is not None), **asked)
    block_m, block_n, block_n2 = cfg["block_m"], cfg["block_n"], cfg["block_n2"]
    if h % CHUNK or inter % CHUNK or inter % block_n or block_n % GROUP:
        raise ValueError(f"hidden {h} and intermediate {inter} must be multiples of {CHUNK}, intermediate "
                         f"of block_n={block_n}, and block_n of {GROUP}")
    for name, w in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if not w.is_contiguous():  # the kernels address the repacked tiles and scale pairs by shape alone
            raise ValueError(f"{name} must be contiguous (shape {tuple(w.shape)}, strides {tuple(w.stride())}): "
                             "the kernel layout is addressed from its shape")
    if input_group % GROUP:
        raise ValueError(f"input_group={input_group} must be a multiple of {GROUP} (0: one scale per token)")
    other = ([n for n in ("gemv", "merge", "shift", "expand", "gemv_prefetch", "shift_only", "pair_bf16") if asked.get(n)]
             + [n for n in ("split_k", "unroll", "unroll_down") if int(asked.get(n, 1)) > 1]
             + (["pair_blocks off"] if asked.get("pair_blocks") is False else []))
    wide = takes_wide(asked, cfg, h, inter)
    if wide and "wide_quant" not in asked and input_group:
        cfg["wide_quant"] = False  # (the in-launch rounding is per token; a per-group input scale takes the launch)
    if wide and other:
        raise ValueError(f"w4a8_moe config wide: its own two kernels; {other} belong to the others (drop them, or wide)")
    if wide:
        return _wide_moe(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, cfg, swiglu_limit,
                         routed_scaling_factor, input_group, out)
    pairs = t * top_k
    dev = x.device
    pair_blocks = bool(cfg.get("pair_blocks", False))  # one pair per M block, no alignment (tiny batches)
    if asked.get("expand") and "pair_blocks" not in asked:
        pair_blocks = False  # default_config's choice yields to the expanded path asked for (aligned blocks only)
    if pair_blocks:
        block_expert = topk_ids.reshape(-1).contiguous()
        sorted_ids = num_padded = block_expert  # not read in this mode
    else:
        sorted_ids, block_expert, num_padded = _align(topk_ids, e, block_m)
    merge = cfg.get("merge", False)  # per-group: faster on the H200 (docs/moe.md)
    span_up = _span(h, input_group, merge)
    span_down = _span(inter, block_n, merge)
    gemv = bool(cfg.get("gemv", False))  # pair blocks on CUDA cores (DP4A), not the 16-row MMA tile
    if "gemv" not in asked and (merge or asked.get("shift") or asked.get("pair_blocks") is False or asked.get("expand")
                                or max(int(asked.get(n, 1)) for n in ("unroll", "unroll_down")) > 1):
        gemv = False  # default_config's choice yields to an MMA-loop option asked for
    gemv_prefetch = int(cfg.get("gemv_prefetch", 0))  # gemv's loads issued this many K steps ahead
    if gemv_prefetch not in (0, 1, 2):
        raise ValueError(f"gemv_prefetch={gemv_prefetch}: 0, 1 or 2 K steps ahead")
    if asked.get("gemv_prefetch") and not gemv:  # (default_config's own yields silently with its gemv)
        raise ValueError(f"gemv_prefetch={asked['gemv_prefetch']} asked for, but this call runs the MMA kernel (gemv "
                         "off: not asked for, or yielding to merge, shift, unroll or pair_blocks off), which has no "
                         "such loop; ask gemv=True with pair_blocks, or drop gemv_prefetch")
    shift = cfg.get("shift", True) and not gemv  # (gemv has no shift path)
    split_k = int(cfg.get("split_k", 1))  # gate-up K shares: more programs when few experts are active
    if "split_k" not in asked:  # default_config's choice yields: to merge or the shift path asked for, and
        if asked.get("merge") or asked.get("shift") or asked.get("expand"):  # to a hidden size it does not divide
            split_k = 1
        while split_k > 1 and h % (split_k * CHUNK):
            split_k //= 2
    if split_k < 1 or split_k > 1 and (merge or h % (split_k * CHUNK)):
        raise ValueError(f"split_k={split_k} needs merge off and hidden {h} a multiple of {CHUNK} x split_k")
    unroll = int(cfg.get("unroll", 1))  # K steps per loop iteration: more weight loads in flight per program
    unroll_down = int(cfg.get("unroll_down", unroll))  # the down launch's own (default: the same)
    if min(unroll, unroll_down) < 1 or max(unroll, unroll_down) > 1 and merge:
        raise ValueError(f"unroll={unroll}, unroll_down={unroll_down}: at least 1, and the per-group loop only "
                         "(merge off)")
    if gemv and (not pair_blocks or merge or max(unroll, unroll_down) > 1):
        raise ValueError("gemv: pair_blocks on, and merge and unroll off (its own loop has neither)")
    shift_up = (split_k == 1 and shift and w13_eref is not None and input_group % CHUNK == 0
                and h * 127 * 96 < 2**31)
    shift_down = shift and w2_eref is not None and block_n % CHUNK == 0 and inter * 127 * 96 < 2**31
    expand = bool(cfg.get("expand", False))  # experts decoded once per call into an INT8 workspace, plain INT8 GEMMs
    map_up = shift_up or expand and w13_eref is not None  # launches that read a shift map (expand: checked below)
    map_down = shift_down or expand and w2_eref is not None
    if map_up:
        w13_eref = w13_eref.view(torch.uint8).contiguous()
    if map_down:
        w2_eref = w2_eref.view(torch.uint8).contiguous()
    if map_up and w13_eref.shape != (e, two_i) or map_down and w2_eref.shape != (e, h):
        raise ValueError("w13_eref / w2_eref must be shift_refs of w13_scale / w2_scale: [E, 2I], [E, H]")
    shift_only = bool(cfg.get("shift_only", False))  # the shift loop alone (no per-group fallback compiled)
    if shift_only and not (shift_up and shift_down):
        raise ValueError(f"shift_only needs the shift path in both launches (gate-up: {shift_up}, down: {shift_down}): "
                         "shift on, the shift maps given, split_k 1, and block_n and the input group multiples of 64")
    block_k = int(input_group or cfg.get("block_k", 128))  # the expanded gate-up's K step (its activation group)
    if expand:
        why = [msg for bad, msg in (
            (gemv or pair_blocks, "gemv and pair_blocks off (aligned M blocks)"),
            (split_k != 1 or merge, "split_k 1 and merge off"),
            (w13_eref is None or w2_eref is None, "both shift maps given (w13_eref, w2_eref)"),
            (block_n % CHUNK or block_n > 256, f"block_n a multiple of {CHUNK} up to 256 (the down launch's K step)"),
            (block_k % CHUNK or block_k > 256 or h % block_k, f"block_k / input_group a multiple of {CHUNK} up to 256 "
                                                              f"that divides hidden {h}"),
            (max(h, inter) * 127 * 96 >= 2**31, "int32 sums that cannot overflow (K < 176k)")) if bad]
        if why:
            raise ValueError(f"w4a8_moe config expand needs {'; '.join(why)} (config {cfg})")
    decode_asm = cfg.get("decode", "asm" if x.is_cuda and not _INTERPRETED else "alu") == "asm"
    fused_io = cfg.get("fused_io", False)  # one-launch quantize and combine (default_config: decode sizes)
    xq, xs = (quantize_rows_int8_fused if fused_io else quantize_rows_int8)(x, input_group)
    hq = torch.empty((pairs, inter), dtype=torch.int8, device=dev)
    groups = inter // block_n
    hs = torch.empty((pairs, groups), dtype=torch.float32, device=dev)
    w13b, w13s = w13.view(torch.uint8), w13_scale.view(torch.uint8)
    w2b, w2s = w2.view(torch.uint8), w2_scale.view(torch.uint8)
    blocks = pairs if pair_blocks else block_expert.numel()
    part = torch.empty((split_k, pairs, 2, inter), dtype=torch.float32, device=dev) if split_k > 1 else hq
    # config pair_bf16: each (token, expert) output stored as BF16 before the top-k sum (fp32 accumulation), as
    # SGLang's Marlin MoE keeps its intermediate cache: half the bytes of the largest buffer in prefill
    # ([pairs, H]: 1.6 GB fp32 at 16K tokens, written once and read once), one BF16 rounding per pair
    y = torch.empty((pairs, h), dtype=torch.bfloat16 if cfg.get("pair_bf16", False) else torch.float32, device=dev)
    tw = topk_weights.reshape(-1).to(torch.float32)
    if expand and blocks:  # the experts' codes expanded share by share into an INT8 workspace, then INT8 GEMMs
        share, ws_bytes, ok_bytes = expand_share(e, two_i, h, cfg.get("expand_mb", 512))
        ws = torch.empty((ws_bytes,), dtype=torch.int8, device=dev)
        ok = torch.empty((ok_bytes,), dtype=torch.uint8, device=dev)
        for gated, wb, wsc, er, n, kk in ((True, w13b, w13s, w13_eref, two_i, h), (False, w2b, w2s, w2_eref, h, inter)):
            w8 = ws[:share * n * kk].view(share, n, kk)
            okm = ok[:share * n].view(share, n)
            for e0 in range(0, e, share):
                n_e = min(share, e - e0)
                expand_experts(wb, wsc, er, w8, okm, e0, n_e, decode_asm)
                if gated:
                    _w8_moe_kernel[(blocks * triton.cdiv(inter, block_n),)](
                        xq, xs, w8, okm, hq, hs, sorted_ids, block_expert, num_padded, topk_weights, inter, h, pairs,
                        top_k, xs.shape[1], float(swiglu_limit), e0, e0 + n_e, xq.stride(0), w8.stride(0),
                        w8.stride(1), okm.stride(0), hq.stride(0), groups, GATED=True, MUL_WEIGHT=False,
                        A_GROUP=input_group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
                else:
                    _w8_moe_kernel[(blocks * triton.cdiv(h, block_n2),)](
                        hq, hs, w8, okm, y, y, sorted_ids, block_expert, num_padded, tw, h, inter, pairs, 1, groups,
                        0.0, e0, e0 + n_e, hq.stride(0), w8.stride(0), w8.stride(1), okm.stride(0), y.stride(0), 0,
                        GATED=False, MUL_WEIGHT=True, A_GROUP=block_n, BLOCK_M=block_m, BLOCK_N=block_n2,
                        BLOCK_K=block_n, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        del ws, ok
        blocks = 0  # (the launches below are the 4-bit kernels'; done)
    if blocks and gemv:  # one column per thread: warps = tile / 32 (split-K partials free the tile from the group)
        gn = int(cfg.get("gemv_n", 128)) if split_k > 1 else block_n
        _w4a8_gemv_kernel[(pairs * triton.cdiv(inter, gn), split_k)](
            xq, xs, w13b, w13s, part, hs, block_expert, topk_weights, inter, h, pairs, top_k, xs.shape[1],
            float(swiglu_limit), xq.stride(0), w13b.stride(0), w13b.stride(1), w13s.stride(0), w13s.stride(1),
            hq.stride(0), groups, GATED=True, MUL_WEIGHT=False, A_GROUP=input_group, BLOCK_N=gn,
            DECODE_ASM=decode_asm, SPLIT_K=split_k, PREFETCH=gemv_prefetch, num_warps=max(1, gn // 32),
            num_stages=cfg["num_stages"])
    elif blocks:  # (pair_blocks: an empty batch launches nothing; aligned, a block is always there)
        _w4a8_moe_kernel[(blocks * triton.cdiv(inter, block_n), split_k)](
            xq, xs, w13b, w13s, part, hs, sorted_ids, block_expert, num_padded, topk_weights,
            w13_eref if shift_up else w13s, inter, h, pairs, top_k, xs.shape[1], float(swiglu_limit),
            xq.stride(0), w13b.stride(0), w13b.stride(1), w13s.stride(0), w13s.stride(1), hq.stride(0), groups,
            w13_eref.stride(0) if shift_up else 0,
            GATED=True, MUL_WEIGHT=False, A_GROUP=input_group, BLOCK_M=block_m, BLOCK_N=block_n,
            SPAN=span_up, DECODE_ASM=decode_asm, SHIFT=shift_up, SPLIT_K=split_k, PAIR_BLOCKS=pair_blocks,
            UNROLL=unroll, SHIFT_ONLY=shift_only, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if split_k > 1 and pairs:
        _glu_finish_kernel[(triton.cdiv(pairs, 16), groups)](
            part, hq, hs, pairs, inter, groups, float(swiglu_limit), SPLIT_K=split_k, BLOCK_R=16, BLOCK_N=block_n,
            num_warps=4)
    if blocks and gemv:
        _w4a8_gemv_kernel[(pairs * triton.cdiv(h, block_n2),)](
            hq, hs, w2b, w2s, y, y, block_expert, tw, h, inter, pairs, 1, groups, 0.0, hq.stride(0), w2b.stride(0),
            w2b.stride(1), w2s.stride(0), w2s.stride(1), y.stride(0), 0, GATED=False, MUL_WEIGHT=True,
            A_GROUP=block_n, BLOCK_N=block_n2, DECODE_ASM=decode_asm, PREFETCH=gemv_prefetch,
            num_warps=max(1, block_n2 // 32),
            num_stages=cfg["num_stages"])
    elif blocks:
        _w4a8_moe_kernel[(blocks * triton.cdiv(h, block_n2),)](
            hq, hs, w2b, w2s, y, y, sorted_ids, block_expert, num_padded, tw,
            w2_eref if shift_down else w2s, h, inter, pairs, 1, groups, 0.0,
            hq.stride(0), w2b.stride(0), w2b.stride(1), w2s.stride(0), w2s.stride(1), y.stride(0), 0,
            w2_eref.stride(0) if shift_down else 0,
            GATED=False, MUL_WEIGHT=True, A_GROUP=block_n, BLOCK_M=block_m, BLOCK_N=block_n2,
            SPAN=span_down, DECODE_ASM=decode_asm, SHIFT=shift_down, PAIR_BLOCKS=pair_blocks,
            UNROLL=unroll_down, SHIFT_ONLY=shift_only, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    if fused_io and (out is None or out.is_contiguous()):
        res = torch.empty((t, h), dtype=x.dtype, device=dev) if out is None else out
        if t:
            _sum_pairs_kernel[(t, triton.cdiv(h, 1024))](y, res, h, float(routed_scaling_factor), TOP_K=top_k,
                                                         BLOCK=1024, num_warps=4)
        return res
    summed = y.view(t, top_k, h).sum(dim=1, dtype=torch.float32)
    if routed_scaling_factor != 1.0:
        summed.mul_(routed_scaling_factor)
    if out is None:
        return summed.to(x.dtype)
    return out.copy_(summed)
