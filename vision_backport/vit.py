"""The Vision-Exp ViT and aligner, in plain PyTorch, parameter names equal to the
checkpoint's keys below `vision.` and `aligner.` (replicated on every TP rank; BF16 weights, norms computed
in fp32).

ViT, one image per call, native resolution: patches [N, 3, p, p] flattened channel-major -> Linear (no conv,
no class token, no absolute positions) -> blocks of pre-norm bidirectional attention with 2D RoPE (pairs
(j, j + d/2) of each head; the first half of the pairs rotate by the patch row, the second half by the
column; q and k only) and a SwiGLU MLP -> RMSNorm. Aligner: the [n_h, n_w] patch grid zero-padded to
multiples of r, unshuffled r x r channel-major, then Linear -> exact GELU -> Linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNormF32(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope_2d_tables(n_h: int, n_w: int, head_dim: int, theta: float, device=None):
    """cos, sin [n_h * n_w, head_dim / 2] (fp32) for row-major patches."""
    half = head_dim // 2
    freqs = theta ** (-2.0 * torch.arange(half // 2, dtype=torch.float64, device=device) / half)
    rows = torch.arange(n_h, dtype=torch.float64, device=device).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.float64, device=device).repeat(n_h)
    angles = torch.cat([rows[:, None] * freqs[None, :], cols[:, None] * freqs[None, :]], dim=1)
    return angles.cos().float(), angles.sin().float()


def apply_rope_2d(x, cos, sin):
    """x [..., N, head_dim]: (x1, x2) halves -> (x1 cos - x2 sin, x2 cos + x1 sin), in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=True)
        self.wo = nn.Linear(dim, dim, bias=True)

    def forward(self, x, cos, sin):
        n, dim = x.shape
        q, k, v = self.wqkv(x).view(n, 3, self.heads, dim // self.heads).permute(1, 2, 0, 3)  # [heads, N, d]
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask
        return self.wo(o.transpose(0, 1).reshape(n, dim))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * inter, bias=False)  # [gate; up]
        self.w2 = nn.Linear(inter, dim, bias=False)

    def forward(self, x):
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, inter: int):
        super().__init__()
        self.norm1, self.norm2 = RMSNormF32(dim), RMSNormF32(dim)
        self.attn = VisionAttention(dim, heads)
        self.mlp = VisionMLP(dim, inter)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(3 * patch * patch, dim, bias=True)

    def forward(self, patches):
        return self.proj(patches.reshape(patches.shape[0], -1))  # (c, y, x) channel-major


class VisionTower(nn.Module):
    """Parameters as `vision.*` in the checkpoint."""

    def __init__(self, dim: int, layers: int, heads: int, inter: int, patch: int, theta: float):
        super().__init__()
        self.heads, self.theta = heads, theta
        self.patch_embed = PatchEmbed(patch, dim)
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, inter) for _ in range(layers))
        self.norm = RMSNormF32(dim)

    def forward(self, patches, n_h: int, n_w: int):
        """patches [n_h * n_w, 3, p, p] (row-major over the grid) -> [n_h * n_w, dim]."""
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"{patches.shape[0]} patches for a {n_h}x{n_w} grid")
        x = self.patch_embed(patches)
        cos, sin = rope_2d_tables(n_h, n_w, x.shape[-1] // self.heads, self.theta, device=x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class VisionAligner(nn.Module):
    """Parameters as `aligner.*` in the checkpoint: a two-layer GELU MLP on r x r unshuffled patches."""

    def __init__(self, vision_dim: int, hidden: int, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.w1 = nn.Linear(vision_dim * ratio * ratio, hidden, bias=True)
        self.w2 = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x, n_h: int, n_w: int):
        """x [n_h * n_w, C] -> [ceil(n_h / r) * ceil(n_w / r), hidden], row-major over the LLM grid."""
        r = self.ratio
        grid = x.t().reshape(1, x.shape[1], n_h, n_w)
        grid = F.pad(grid, (0, (-n_w) % r, 0, (-n_h) % r))
        tokens = F.pixel_unshuffle(grid, r)  # [1, C * r * r, H / r, W / r]: channel c*r*r + ky*r + kx
        tokens = tokens.flatten(2)[0].t()
        return self.w2(F.gelu(self.w1(tokens)))
