"""The model's own block roundings as Triton helpers, without FP8/FP4 types (SM80 has neither; reference:
`block_rounding_ref.py`; design: docs/attention.md).

DeepSeek-V4 was trained with two quantization simulations that its inference code applies in place:
- FP8 (window and compressed attention KV, the 448 non-rope dims): blocks of 64, scale
  s = 2^ceil(log2(max(amax, 1e-4) / 448)), x / s clamped to +-448 and rounded to e4m3 (nearest, ties to
  even), times s. The result is exact in BF16 (4 significant bits times a power of two).
- FP4 (indexer query and keys, after the Hadamard rotation): blocks of 32, s = 2^ceil(log2(max(amax, 6 *
  2^-126) / 6)), x / s clamped to +-6 and rounded to e2m1 (ties to even). 2 * e2m1 is an integer of at most
  12 in magnitude: an INT8 code, with the scale kept as its exponent.

Every step is exact fp32 arithmetic on bit patterns and powers of two built from bits (no division, no libdevice
rounding function), so the kernels, the interpreter and the reference agree bit for bit. The scale is computed as
the model's kernel computes it: the fp32 product amax * fl(1/max), then ceil(log2) from its bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_BLOCK = 64
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP4_BLOCK = 32
FP4_MAX = 6.0
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126


@triton.jit
def round_bf16(x):
    """fp32 x rounded to BF16 (nearest, ties to even) and widened back, from its bits: Triton's CPU interpreter
    converts fp32 to BF16 by truncation, a GPU build to nearest; this agrees with both torch and the GPU."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2(e):
    """2^e (fp32) for an integer tensor e in [-126, 127], from its bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def floor_log2(a):
    """floor(log2(a)) of a positive normal fp32 a, from its exponent bits (zero and subnormals give -127)."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def ceil_log2_scaled(amax, inv_max):
    """ceil(log2(amax * inv_max)) with the product rounded to fp32 first, as the model's quantizer does; the
    caller clamps amax so the product is a normal number."""
    t = amax * inv_max
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def round_half_even(y):
    """y (fp32, |y| < 2^22) to the nearest integer, ties to even; floor and the fraction are exact in fp32."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


@triton.jit
def round_to_float_grid(a, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """a >= 0 (fp32, already clamped to the format's range) onto the grid of a float format with MANT mantissa
    bits and smallest normal exponent MIN_EXP (subnormals below it), nearest, ties to even."""
    step_exp = tl.maximum(floor_log2(a), MIN_EXP) - MANT
    return round_half_even(a * pow2(-step_exp)) * pow2(step_exp)


@triton.jit
def with_sign_of(r, x):
    """r >= 0 with the sign bit of x (a value rounded to zero keeps its sign, as a float cast does; Triton's
    unary minus is 0 - r, which would give +0)."""
    bits = r.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_block_exp(amax):
    """log2 of the power-of-two FP8 scale of a block whose absolute maximum is amax (int32, in [-22, 120])."""
    return ceil_log2_scaled(tl.maximum(amax, 1e-4), 1.0 / 448.0)


@triton.jit
def fp8_sim(x, e):
    """x (fp32) through the e4m3 simulation with the scale 2^e (e broadcast against x): exact values."""
    a = tl.minimum(tl.abs(x) * pow2(-e), 448.0)
    return with_sign_of(round_to_float_grid(a, 3, -6) * pow2(e), x)


@triton.jit
def fp4_block_exp(amax):
    """log2 of the power-of-two FP4 scale of a block whose absolute maximum is amax (int32, in [-126, 126])."""
    return ceil_log2_scaled(tl.maximum(amax, 6.0 * 2.0 ** -126), 1.0 / 6.0)


@triton.jit
def fp4_codes(x, e):
    """x (fp32) through the e2m1 simulation with the scale 2^e: 2 * e2m1 value, an integer-valued fp32 in
    [-12, 12] (the value is code * 2^e / 2)."""
    a = tl.minimum(tl.abs(x) * pow2(-e), 6.0)
    return with_sign_of(2.0 * round_to_float_grid(a, 1, 0), x)
