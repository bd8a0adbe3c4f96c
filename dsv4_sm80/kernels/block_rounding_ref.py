"""Plain-PyTorch references for the model's block roundings (`block_rounding.py`) and the stores and
indexer that use them, written from the math in float64 (the format grids are enumerated from their
definitions; no FP8/FP4 cast is used).

- e4m3 (finite, `fn`): subnormals m * 2^-9 (m = 0..7), normals (1 + m/8) * 2^(E-7) for E = 1..15, the top
  code (E = 15, m = 7) being NaN: largest 448. e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6. Rounding is to the nearest
  grid value, a tie going to the value with the even code (even last mantissa bit).
- FP8 simulation: blocks of 64, s = 2^ceil(log2(max(amax, 1e-4) / 448)), value = e4m3(clamp(x / s)) * s.
- FP4 simulation: blocks of 32, s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), value = e2m1(clamp(x / s)) * s;
  stored as the INT8 code 2 * e2m1 and the exponent log2(s).
- KV rows [N, 512]: the first 448 dims (nope) FP8-simulated, the last 64 (rope) untouched.
- Index entries in the 132-byte layout: 128 INT8 codes, then (this option) 4 INT8 block exponents where the
  INT8 path keeps an fp32 row scale. Index queries: [T, H, 132] INT8 in the same layout.
"""

from __future__ import annotations

import functools

import torch

from .kv_store_ref import IDX_DIM, PAGE, hadamard128, rope_pairs

NOPE = 448


@functools.cache
def e4m3_grid() -> torch.Tensor:
    """The non-negative finite e4m3fn values in code order (code = index)."""
    vals = [m * 2.0 ** -9 for m in range(8)]
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(vals, dtype=torch.float64)


@functools.cache
def e2m1_grid() -> torch.Tensor:
    return torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def round_to_grid(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """v (float64, |v| <= grid max) to the nearest grid value, ties to the even code."""
    a = v.abs()
    hi = torch.searchsorted(grid, a).clamp(max=grid.numel() - 1)  # first grid value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.sign(v) * grid[torch.where(pick_hi, hi, lo)]


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) exactly, for positive float64 x (frexp: x = m * 2^e with m in [0.5, 1))."""
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, e - 1, e).to(torch.int64)


def fp8_sim_ref(x: torch.Tensor, block: int = 64):
    """x [..., D] -> (values float64 [..., D], block exponents int64 [..., D / block])."""
    xb = x.to(torch.float64).unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1).clamp(min=1e-4)
    e = ceil_log2(amax / 448.0)
    s = torch.ldexp(torch.ones_like(amax), e)[..., None]
    v = round_to_grid((xb / s).clamp(-448.0, 448.0), e4m3_grid()) * s
    return v.flatten(-2), e


def kv_fp8_sim_ref(rows: torch.Tensor) -> torch.Tensor:
    """BF16 key rows [N, 512] as the model stores them: the nope part FP8-simulated, the rope part untouched
    (the result is exact in BF16)."""
    out = rows.to(torch.float64).clone()
    out[..., :NOPE] = fp8_sim_ref(rows[..., :NOPE])[0]
    return out.to(torch.bfloat16)


def fp4_sim_ref(x: torch.Tensor, block: int = 32):
    """x [..., D] -> (values float64, INT8 codes 2 * e2m1 [..., D], block exponents int64 [..., D / block])."""
    xb = x.to(torch.float64).unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1).clamp(min=6.0 * 2.0 ** -126)
    e = ceil_log2(amax / 6.0)
    s = torch.ldexp(torch.ones_like(amax), e)[..., None]
    v = round_to_grid((xb / s).clamp(-6.0, 6.0), e2m1_grid())
    return (v * s).flatten(-2), (2 * v).flatten(-2).to(torch.int8), e


def fp4_dequant(codes: torch.Tensor, exps: torch.Tensor, block: int = 32) -> torch.Tensor:
    """INT8 codes [..., D] and block exponents [..., D / block] -> float64 values code / 2 * 2^e."""
    c = codes.to(torch.float64).unflatten(-1, (-1, block)) / 2
    return torch.ldexp(c, exps.to(torch.int64)[..., None]).flatten(-2)


def index_k_fp4_ref(x: torch.Tensor):
    """Final index K values [N, 128] (fp32; the model hands BF16 to its quantizer) -> (codes, exponents)."""
    _, codes, e = fp4_sim_ref(x.to(torch.bfloat16))
    return codes, e


def q_indexer_fp4_ref(q, weight, weight_scale, freqs_cis, positions):
    """q [T, H, 128], weight [T, H] -> (q rows [T, H, 132] INT8: codes then 4 block exponents, weights_out
    [T, H, 1] fp32 = w * weight_scale / 4, the 1/2 of each code folded in): RoPE on dims 64..127, Hadamard /
    sqrt(128), rounded to BF16 (the model's rotation returns BF16), FP4-simulated per 32."""
    x = q.to(torch.float64).clone()
    x[..., 64:] = rope_pairs(x[..., 64:], freqs_cis, positions)
    x = (x @ hadamard128().T / IDX_DIM ** 0.5).to(torch.bfloat16)
    _, codes, e = fp4_sim_ref(x)
    rows = torch.cat([codes, e.to(torch.int8)], dim=-1)
    return rows, (weight.to(torch.float64) * weight_scale / 4).to(torch.float32).unsqueeze(-1)


def index_fp4_pages_read(cache: torch.Tensor, slot: torch.Tensor):
    """From the uint8 page buffer [pages, 64 * 132]: (INT8 codes [N, 128], INT8 block exponents [N, 4])."""
    flat = cache.view(-1, PAGE * (IDX_DIM + 4))
    page, off = slot // PAGE, slot % PAGE
    codes = torch.stack([flat[p, o * IDX_DIM:(o + 1) * IDX_DIM] for p, o in zip(page.tolist(), off.tolist())])
    exps = torch.stack([flat[p, PAGE * IDX_DIM + 4 * o: PAGE * IDX_DIM + 4 * o + 4]
                        for p, o in zip(page.tolist(), off.tolist())])
    return codes.view(torch.int8), exps.view(torch.int8)


def logits_fp4_ref(q_rows, kv_pages, weights, seq_lens, page_table, max_len):
    """logits[t, j] = sum_h weights[t, h] * ReLU(4 * q[t, h] . k[j]) for j < seq_lens[t] (else 0), q and k the
    FP4-simulated values (code / 2 * 2^e); the 4 cancels the 1/4 folded into the weights."""
    t_total, heads = q_rows.shape[0], q_rows.shape[-2]
    q_rows = q_rows.reshape(t_total, heads, IDX_DIM + 4)
    out = torch.zeros(t_total, max_len, dtype=torch.float64)
    for t in range(t_total):
        n = int(seq_lens.reshape(-1)[t])
        if n == 0:
            continue
        j = torch.arange(n)
        slots = page_table[t, j // PAGE].long() * PAGE + j % PAGE
        codes, exps = index_fp4_pages_read(kv_pages, slots)
        k = fp4_dequant(codes, exps)
        q = fp4_dequant(q_rows[t, :, :IDX_DIM], q_rows[t, :, IDX_DIM:])
        dots = 4 * q @ k.T  # [H, n]
        out[t, :n] = (torch.relu(dots) * weights[t].reshape(-1, 1).to(torch.float64)).sum(0)
    return out
