"""Plain-PyTorch references for the SM80 cache writers (`kv_store.py`, `indexer_int8.py`), written from
the model's math and the contracts of the 0.5.16 JIT kernels they replace (the FP8 KV store
`fused_k_norm_rope_flashmla`, the indexer's Q quantization, index K store and paged logits). The model's own
block roundings (the fp8_sim / fp4_sim options) have their reference in `block_rounding_ref.py`.

- RoPE is on interleaved pairs (x[2i], x[2i+1]) of the rotated dims, as the complex product with
  freqs_cis[pos, i] (complex64 [max_pos, dims/2]).
- The indexer's Hadamard is the Sylvester (natural-order) +-1 matrix H128, scaled by 1/sqrt(128).
- INT8 rows: s = max(1e-4, max|x|) / 127, q = round-half-away(x / s) clamped to [-127, 127].
- The index cache page (64 entries) keeps 0.5.16's 132-byte-per-entry layout: 64 x 128 value bytes,
  then 64 fp32 scales; entry slot = page * 64 + offset.
"""

from __future__ import annotations

import torch

PAGE = 64
IDX_DIM = 128


def rope_pairs(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [..., N, 2r] float, rotated in pairs by freqs_cis[positions] ([N, r] complex)."""
    xc = torch.view_as_complex(x.to(torch.float64).unflatten(-1, (-1, 2)).contiguous())
    f = freqs_cis[positions.long()].to(torch.complex128)
    while f.dim() < xc.dim():
        f = f.unsqueeze(-2)
    return torch.view_as_real(xc * f).flatten(-2)


def k_norm_rope_ref(kv, weight, eps, freqs_cis, positions, rope_dims=64):
    """RMSNorm with weight, then RoPE on the last `rope_dims` dims, in float64 -> [N, D]."""
    x = kv.to(torch.float64)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float64)
    out = x.clone()
    out[:, -rope_dims:] = rope_pairs(x[:, -rope_dims:], freqs_cis, positions)
    return out


def hadamard128() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < IDX_DIM:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def int8_rows(x: torch.Tensor):
    s = torch.clamp(x.abs().amax(-1, keepdim=True), min=1e-4) / 127.0
    v = x / s
    q = torch.clamp(torch.sign(v) * torch.floor(v.abs() + 0.5), -127, 127)
    return q.to(torch.int8), s.squeeze(-1)


def q_indexer_ref(q, weight, weight_scale, freqs_cis, positions):
    """q [T, H, 128], weight [T, H] -> (q_int8 [T, H, 128], weights_out [T, H, 1] fp32):
    RoPE on dims 64..127, Hadamard / sqrt(128), INT8 per head; weights_out = w * weight_scale * s_q."""
    x = q.to(torch.float64).clone()
    x[..., 64:] = rope_pairs(x[..., 64:], freqs_cis, positions)
    x = x @ hadamard128().T / IDX_DIM ** 0.5
    qi, s = int8_rows(x)
    return qi, (weight.to(torch.float64) * weight_scale * s).to(torch.float32).unsqueeze(-1)


def index_pages_read(cache: torch.Tensor, slot: torch.Tensor):
    """From the uint8 page buffer [pages, 64 * 132]: (int8 values [N, 128], fp32 scales [N]) of slots."""
    flat = cache.view(-1, PAGE * (IDX_DIM + 4))
    page, off = slot // PAGE, slot % PAGE
    vals = torch.stack([flat[p, o * IDX_DIM:(o + 1) * IDX_DIM] for p, o in zip(page.tolist(), off.tolist())])
    sc = torch.stack([flat[p, PAGE * IDX_DIM + 4 * o: PAGE * IDX_DIM + 4 * o + 4] for p, o in zip(page.tolist(),
                                                                                                   off.tolist())])
    return vals.view(torch.int8), sc.contiguous().view(torch.float32).squeeze(-1)


def logits_ref(q_int8, kv_pages, weights, seq_lens, page_table, max_len, magnitude: bool = False):
    """logits[t, j] = s_k[j] * sum_h ReLU(q8[t,h] . k8[j]) * weights[t,h] for j < seq_lens[t] (else 0).
    magnitude: also |s_k[j]| * sum_h |ReLU(q8[t,h] . k8[j]) * weights[t,h]|, the scale of the rounding error of any
    fp32 evaluation of that sum (the terms cancel, so the logit itself can be far smaller)."""
    t_total = q_int8.shape[0]
    out = torch.zeros(t_total, max_len, dtype=torch.float64)
    mag = torch.zeros_like(out)
    for t in range(t_total):
        n = int(seq_lens[t])
        if n == 0:
            continue
        j = torch.arange(n)
        slots = page_table[t, j // PAGE].long() * PAGE + j % PAGE
        k8, sk = index_pages_read(kv_pages, slots)
        dots = q_int8[t].to(torch.float64) @ k8.to(torch.float64).T  # [H, n] (exact: int sums)
        terms = torch.relu(dots) * weights[t].reshape(-1, 1).to(torch.float64)
        out[t, :n] = terms.sum(0) * sk.to(torch.float64)
        mag[t, :n] = terms.abs().sum(0) * sk.to(torch.float64).abs()
    return (out, mag) if magnitude else out
