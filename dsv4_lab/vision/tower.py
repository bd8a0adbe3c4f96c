"""Vision-Exp ViT + aligner + the four image-block vectors, fp32 and differentiable, parameter names equal to
the checkpoint's (`vision.*`, `aligner.*`, `image_start` / `image_end` / `image_newline` / `image_pad`).

ViT: patches [N, 3, p, p] flattened (c, y, x) -> Linear with bias (no conv, class token or absolute
position) -> pre-norm blocks: RMSNorm, bidirectional attention over the whole image with 2D RoPE on q and k
(pair (j, j + d/2) of each head; pairs 0 .. d/4 - 1 turn by the patch row, the rest by the column), RMSNorm,
SwiGLU (w1 = [gate; up]) -> RMSNorm. Aligner: the patch grid zero-padded at the bottom / right to multiples of
r, each r x r cell flattened c * r * r + ky * r + kx, Linear -> exact GELU -> Linear. Sources per convention:
docs/vision.md, "Conventions and their sources".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .image import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START, layout, llm_side, patchify

RMS_EPS = 1e-6  # the ViT's own; config.rms_norm_eps (1e-20 in Vision-Exp) is the text model's
SENTINELS = {IMAGE_START: "image_start", IMAGE_PAD: "image_pad", IMAGE_NEW_LINE: "image_newline",
             IMAGE_END: "image_end"}


def _get(config, key):
    return config[key] if isinstance(config, dict) else getattr(config, key)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * self.weight.float()


def rope_angles(n_h: int, n_w: int, head_dim: int, theta: float, device=None):
    """[n_h * n_w, head_dim / 2] fp32 angles, patches row-major: [row * f_k for k] + [col * f_k for k],
    f_k = theta^(-2k / (head_dim / 2)); fp32 throughout, as the release builds its tables."""
    half = head_dim // 2
    inv = 1.0 / theta ** (torch.arange(half // 2, dtype=torch.float32, device=device) * 2 / half)
    row = torch.arange(n_h, device=device).repeat_interleave(n_w).float()
    col = torch.arange(n_w, device=device).repeat(n_h).float()
    return torch.cat([row[:, None] * inv, col[:, None] * inv], dim=1)


def rotate(x, angles):
    """x [..., N, d]: each pair (x[j], x[j + d/2]) as a complex number turned by angles[:, j]."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].float(), x[..., half:].float())
    z = z * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim)  # output rows: q | k | v, each head-major
        self.wo = nn.Linear(dim, dim)

    def forward(self, x, angles):
        n, dim = x.shape
        d = dim // self.heads
        q, k, v = (t.reshape(n, self.heads, d).transpose(0, 1) for t in self.wqkv(x).split(dim, dim=-1))
        q, k = rotate(q, angles), rotate(k, angles)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)  # no mask: bidirectional
        return self.wo((weights @ v).transpose(0, 1).reshape(n, dim))


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.inter = inter
        self.w1 = nn.Linear(dim, 2 * inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)

    def forward(self, x):
        gate, up = self.w1(x).split(self.inter, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, inter: int):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = RMSNorm(dim)
        self.mlp = MLP(dim, inter)

    def forward(self, x, angles):
        x = x + self.attn(self.norm1(x), angles)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(3 * patch * patch, dim)


class ViT(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, inter: int, patch: int, theta: float):
        super().__init__()
        self.heads, self.theta = heads, theta
        self.patch_embed = PatchEmbed(patch, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, inter) for _ in range(layers))
        self.norm = RMSNorm(dim)

    def forward(self, patches, n_h: int, n_w: int):
        """[n_h * n_w, 3, p, p] row-major -> [n_h * n_w, dim]."""
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"{patches.shape[0]} patches for a {n_h}x{n_w} grid")
        x = self.patch_embed.proj(patches.float().flatten(1))
        angles = rope_angles(n_h, n_w, x.shape[-1] // self.heads, self.theta, x.device)
        for block in self.blocks:
            x = block(x, angles)
        return self.norm(x)


class Aligner(nn.Module):
    def __init__(self, vision_dim: int, hidden: int, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.w1 = nn.Linear(vision_dim * ratio * ratio, hidden)
        self.w2 = nn.Linear(hidden, hidden)

    def merge(self, x, n_h: int, n_w: int):
        """[n_h * n_w, C] -> [ceil(n_h / r) * ceil(n_w / r), C * r * r], cells row-major."""
        r, c = self.ratio, x.shape[-1]
        rows, cols = llm_side(n_h, r), llm_side(n_w, r)
        g = F.pad(x.view(n_h, n_w, c), (0, 0, 0, cols * r - n_w, 0, rows * r - n_h))  # zeros bottom / right
        g = g.view(rows, r, cols, r, c).permute(0, 2, 4, 1, 3)  # [row, col, c, ky, kx]
        return g.reshape(rows * cols, c * r * r)

    def forward(self, x, n_h: int, n_w: int):
        return self.w2(F.gelu(self.w1(self.merge(x, n_h, n_w)), approximate="none"))


class Tower(nn.Module):
    """Built from a config with the flat `vision_*` fields and `hidden_size`."""

    def __init__(self, config):
        super().__init__()
        self.patch = int(_get(config, "vision_patch_size"))
        self.ratio = int(_get(config, "vision_downsample_ratio"))
        dim, hidden = int(_get(config, "vision_dim")), int(_get(config, "hidden_size"))
        self.vision = ViT(dim, int(_get(config, "vision_n_layers")), int(_get(config, "vision_n_heads")),
                          int(_get(config, "vision_inter_dim")), self.patch, float(_get(config, "vision_rope_theta")))
        self.aligner = Aligner(dim, hidden, self.ratio)
        for name in ("image_start", "image_end", "image_newline", "image_pad"):
            self.register_parameter(name, nn.Parameter(torch.zeros(hidden)))
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator=None):
        """The tiny generator's rules: linear weights and the four vectors N(0, std), biases 0, norms 1."""
        def normal(p):
            p.copy_(torch.randn(p.shape, generator=generator) * std)

        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, nn.Linear):
                normal(m.weight)
                if m.bias is not None:
                    m.bias.zero_()
        for name in SENTINELS.values():
            normal(getattr(self, name))

    def encode(self, patches, n_vit_h: int, n_vit_w: int):
        """Patches [n_vit_h * n_vit_w, 3, p, p] -> aligner rows [n_llm_h * n_llm_w, hidden], row-major."""
        return self.aligner(self.vision(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)

    def forward(self, pixels):
        """Normalised pixels [3, H, W] (whole patches) -> aligner rows, row-major over the LLM grid."""
        n_vit_h, n_vit_w = pixels.shape[-2] // self.patch, pixels.shape[-1] // self.patch
        return self.encode(patchify(pixels.float(), self.patch), n_vit_h, n_vit_w)

    def assemble(self, rows, block):
        """One row per slot of `block` (a BlockLayout): sentinel vectors, and aligner row block.rows[i] for
        the IMAGE slots. Gathered from one table, so gradients reach rows and vectors alike."""
        order = (IMAGE_START, IMAGE_PAD, IMAGE_NEW_LINE, IMAGE_END)
        table = torch.cat([torch.stack([getattr(self, SENTINELS[k]) for k in order]).float(), rows.float()])
        index = [len(order) + r if k == IMAGE else order.index(k) for k, r in zip(block.kinds, block.rows)]
        return table[torch.tensor(index, device=table.device)]

    def block_embeddings(self, pixels, start_pos: int):
        """[block_len, hidden]: the image's whole token block at absolute prompt position start_pos."""
        n_vit_h, n_vit_w = pixels.shape[-2] // self.patch, pixels.shape[-1] // self.patch
        block = layout(llm_side(n_vit_h, self.ratio), llm_side(n_vit_w, self.ratio), start_pos)
        return self.assemble(self(pixels), block)
