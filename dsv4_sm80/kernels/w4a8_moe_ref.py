"""Plain-PyTorch references for the routed-expert MoE, written from the math, for the kernel tests and
the benchmark's accuracy column. Nothing here uses the kernel or its layout: weights are the
checkpoint's MXFP4 bytes ([N, K/2], low nibble = even k) and E8M0 scale bytes ([N, K/32]).

- `moe_exact`: float64 dequantized weights, float64 activations: what a lossless W4A16 path (SGLang's
  MXFP4 Marlin) approximates up to BF16 rounding of its activations.
- `moe_int8_emulated`: the same, with the activations rounded to INT8 exactly where the W4A8 kernels
  round them (per token for the layer input; per pair and `group` columns for the intermediate). The
  W4A8 kernels must match it up to fp32 accumulation order: the weight side is exact.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] MXFP4 bytes + [..., N, K/32] E8M0 bytes -> float64 [..., N, K]."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # low nibble = even k
    table = torch.tensor(E2M1, dtype=torch.float64, device=packed.device)
    vals = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).to(torch.float64)
    e = scale.view(torch.uint8).to(torch.float64)
    return vals * torch.exp2(e - 127.0).repeat_interleave(32, dim=-1)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DSV4's expert activation (SGLang fused_marlin_moe.swiglu_limit_func): silu(min(gate, limit)) *
    clamp(up, -limit, limit)."""
    if limit > 0:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    return gate * torch.sigmoid(gate) * up


def int8_round_trip(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x rounded to symmetric INT8 with one scale max|x|/127 per row (or per row and `group` columns),
    half away from zero, returned dequantized."""
    shape = x.shape
    g = x if group is None else x.reshape(*shape[:-1], shape[-1] // group, group)
    s = g.abs().amax(dim=-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = g / s
    q = torch.clamp(torch.sign(v) * torch.floor(v.abs() + 0.5), -127, 127)
    return (q * s).reshape(shape)


def _moe(x, w13, s13, w2, s2, topk_weights, topk_ids, limit, scaling, quant_group):
    x = x.to(torch.float64)
    if quant_group is not None:  # the kernel quantizes in fp32
        x = int8_round_trip(x.float()).to(torch.float64)
    w13f, w2f = dequant_mxfp4(w13, s13), dequant_mxfp4(w2, s2)
    inter = w13f.shape[1] // 2
    out = torch.zeros(x.shape[0], w2f.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gu = w13f[e] @ x[t]
            h = swiglu_clamped(gu[:inter], gu[inter:], limit)
            if quant_group is not None:
                h = int8_round_trip(h.float()[None], quant_group)[0].to(torch.float64)
            out[t] += float(topk_weights[t, k]) * (w2f[e] @ h)
    return out * scaling


def moe_exact(x, w13, s13, w2, s2, topk_weights, topk_ids, *, limit=10.0, scaling=1.0):
    return _moe(x, w13, s13, w2, s2, topk_weights, topk_ids, limit, scaling, None)


def moe_int8_emulated(x, w13, s13, w2, s2, topk_weights, topk_ids, *, limit=10.0, scaling=1.0, group=64):
    return _moe(x, w13, s13, w2, s2, topk_weights, topk_ids, limit, scaling, group)
