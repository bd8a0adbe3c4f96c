"""The Vision-Exp ViT and aligner (vision_backport/vit.py) against an independent float64 reference written
from the release's model code: explicit einsum attention, RoPE as a complex rotation of the pairs (j, j + d/2),
RMSNorm in float64, the aligner's unshuffle as an explicit gather (channel c*r*r + ky*r + kx, zero past the
grid's edge), exact-erf GELU. fp32 within 1e-5, BF16 within 2e-2 relative; grids not divisible by 3,
1 x N and N x 1 included."""

import math

import pytest
import torch

from vision_backport.vit import VisionAligner, VisionTower

DIM, LAYERS, HEADS, INTER, PATCH, THETA, HIDDEN, R = 64, 2, 4, 96, 14, 10000.0, 48, 3


def make(seed=0):
    torch.manual_seed(seed)
    tower, aligner = VisionTower(DIM, LAYERS, HEADS, INTER, PATCH, THETA), VisionAligner(DIM, HIDDEN, R)
    with torch.no_grad():
        for p in list(tower.parameters()) + list(aligner.parameters()):
            p.copy_(torch.randn_like(p) * (0.05 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 and p.shape[0] == DIM
                                                                         and p.dtype == torch.float32 else 0.0))
    return tower, aligner


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference(tower, aligner, patches, n_h, n_w):
    P = {k: v.detach().double() for k, v in list(tower.named_parameters()) + [("al." + k, v) for k, v in
                                                                             aligner.named_parameters()]}
    x = patches.double().reshape(patches.shape[0], -1) @ P["patch_embed.proj.weight"].T + P["patch_embed.proj.bias"]
    n, d = x.shape[0], DIM // HEADS
    f = THETA ** (-2.0 * torch.arange(d // 4, dtype=torch.float64) / (d // 2))
    rows = torch.tensor([i // n_w for i in range(n)], dtype=torch.float64)
    cols = torch.tensor([i % n_w for i in range(n)], dtype=torch.float64)
    rot = torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                      torch.cat([rows[:, None] * f, cols[:, None] * f], 1))

    def rope(t):  # t [H, N, d]: pairs (j, j + d/2) as complex numbers
        z = torch.complex(t[..., : d // 2], t[..., d // 2:]) * rot
        return torch.cat([z.real, z.imag], -1)

    for i in range(LAYERS):
        b = f"blocks.{i}."
        h = rms(x, P[b + "norm1.weight"])
        qkv = (h @ P[b + "attn.wqkv.weight"].T + P[b + "attn.wqkv.bias"]).view(n, 3, HEADS, d)
        q, k, v = (qkv[:, j].transpose(0, 1) for j in range(3))
        s = torch.einsum("hqd,hkd->hqk", rope(q), rope(k)) / math.sqrt(d)
        o = torch.einsum("hqk,hkd->hqd", torch.softmax(s, -1), v).transpose(0, 1).reshape(n, DIM)
        x = x + o @ P[b + "attn.wo.weight"].T + P[b + "attn.wo.bias"]
        g, u = (rms(x, P[b + "norm2.weight"]) @ P[b + "mlp.w1.weight"].T).chunk(2, -1)
        x = x + (g * torch.sigmoid(g) * u) @ P[b + "mlp.w2.weight"].T
    x = rms(x, P["norm.weight"])
    lh, lw = -(-n_h // R), -(-n_w // R)
    cells = torch.zeros(lh * lw, DIM * R * R, dtype=torch.float64)
    for ci in range(lh):
        for cj in range(lw):
            for c in range(DIM):
                for ky in range(R):
                    for kx in range(R):
                        y, xx = ci * R + ky, cj * R + kx
                        if y < n_h and xx < n_w:
                            cells[ci * lw + cj, c * R * R + ky * R + kx] = x[y * n_w + xx, c]
    a = cells @ P["al.w1.weight"].T + P["al.w1.bias"]
    a = 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))
    return x, a @ P["al.w2.weight"].T + P["al.w2.bias"]


@pytest.mark.parametrize("n_h,n_w", [(4, 5), (3, 3), (1, 7), (7, 1), (2, 6)])
def test_tower_and_aligner_against_the_reference(n_h, n_w):
    tower, aligner = make()
    patches = torch.randn(n_h * n_w, 3, PATCH, PATCH, generator=torch.Generator().manual_seed(n_h * 10 + n_w))
    want_vit, want_tokens = reference(tower, aligner, patches, n_h, n_w)
    with torch.no_grad():
        vit = tower(patches, n_h, n_w)
        tokens = aligner(vit, n_h, n_w)
    assert tokens.shape == (math.ceil(n_h / 3) * math.ceil(n_w / 3), HIDDEN)
    assert (vit.double() - want_vit).abs().max() <= 1e-5 * max(1.0, want_vit.abs().max().item())
    assert (tokens.double() - want_tokens).abs().max() <= 1e-5 * max(1.0, want_tokens.abs().max().item())
    # BF16 weights and activations, as served
    tower_b, aligner_b = tower.to(torch.bfloat16), aligner.to(torch.bfloat16)
    for m in tower_b.modules():  # the norms keep fp32 weights, as the checkpoint's are held
        if hasattr(m, "eps"):
            m.weight.data = m.weight.data.float()
    with torch.no_grad():
        tb = aligner_b(tower_b(patches.to(torch.bfloat16), n_h, n_w), n_h, n_w)
    rel = ((tb.double() - want_tokens).norm() / want_tokens.norm()).item()
    assert rel <= 2e-2, rel


def test_parameters_are_the_checkpoint_tensors():
    """Names and shapes equal the Vision-Exp checkpoint's vision.* / aligner.* tensors (the format inventory)."""
    from dsv4_sm80.checkpoint import format as fmt
    from dsv4_sm80.tiny.generate import PRESETS, tiny_config

    c = tiny_config(PRESETS["tiny"], vision=True)
    tower = VisionTower(int(c["vision_dim"]), int(c["vision_n_layers"]), int(c["vision_n_heads"]),
                        int(c["vision_inter_dim"]), int(c["vision_patch_size"]), float(c["vision_rope_theta"]))
    aligner = VisionAligner(int(c["vision_dim"]), int(c["hidden_size"]), int(c["vision_downsample_ratio"]))
    got = {f"vision.{k}": tuple(v.shape) for k, v in tower.named_parameters()}
    got |= {f"aligner.{k}": tuple(v.shape) for k, v in aligner.named_parameters()}
    want = {s.name: s.shape for s in fmt.inventory(c) if s.name.startswith(("vision.", "aligner."))}
    assert got == want
