"""The Vision-Exp additions the VL wrapper carries beside the text model (reference 03 §3, §7.1), and how
their weights are told apart from the text model's.

- `is_dsv4_vision(config)`: a DeepSeek-V4 config with the ten `vision_*` fields and a non-empty ViT.
- `split_vision_weights(weights, sink)`: the checkpoint's (name, tensor) stream with `vision.*`, `aligner.*`
  and `image_*` sent to `sink` and everything else passed on, so the text model's loader never sees them
  (stock 0.5.16 renames `aligner.w1` to `aligner.gate_up_proj` and dies on a KeyError, reference 03 §1.4).
- `VisionPart`: ViT + aligner + the four learned sentinel vectors, parameter names equal to the checkpoint
  keys, BF16 as stored (the ViT's RMSNorm weights are held in fp32 and computed in fp32). `load` refuses an
  unknown name or a shape that differs, `missing` lists what never arrived; `image_embeddings` turns one
  processor item (patches, ViT grid, block types and perm) into the whole block's embedding rows: START /
  PAD / NEW_LINE / END rows are the sentinel vectors, IMAGE rows the aligner rows in `perm` order — exactly
  what SGLang's multimodal embedding routine scatters over the block's positions.
"""

from __future__ import annotations

import torch
from torch import nn

from .image_processing import IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START, ImageBlock, block_embeddings
from .vit import VisionAligner, VisionTower

VISION_PREFIXES = ("vision.", "aligner.", "image_")
VISION_FIELDS = ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                 "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
                 "vision_max_wh_ratio")
SENTINELS = {IMAGE_START: "image_start", IMAGE_PAD: "image_pad", IMAGE_NEW_LINE: "image_newline",
             IMAGE_END: "image_end"}


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def is_dsv4_vision(config) -> bool:
    return (_get(config, "model_type") == "deepseek_v4"
            and all(_get(config, k) is not None for k in VISION_FIELDS)
            and int(_get(config, "vision_n_layers", 0)) > 0)


def split_vision_weights(weights, sink):
    """Yield the text model's (name, tensor) pairs; hand the vision ones to sink(name, tensor)."""
    for name, tensor in weights:
        if name.startswith(VISION_PREFIXES):
            sink(name, tensor)
        else:
            yield name, tensor


class VisionLoadError(RuntimeError):
    pass


class VisionPart(nn.Module):
    def __init__(self, config, dtype=torch.bfloat16):
        super().__init__()
        g = lambda k: _get(config, k)  # noqa: E731
        hidden = int(g("hidden_size"))
        self.vision = VisionTower(int(g("vision_dim")), int(g("vision_n_layers")), int(g("vision_n_heads")),
                                  int(g("vision_inter_dim")), int(g("vision_patch_size")), float(g("vision_rope_theta")))
        self.aligner = VisionAligner(int(g("vision_dim")), hidden, int(g("vision_downsample_ratio")))
        self.to(dtype)
        for m in self.vision.modules():  # RMSNorm weights stay fp32 (computed in fp32)
            if hasattr(m, "eps"):
                m.weight.data = m.weight.data.float()
        for name in SENTINELS.values():
            self.register_parameter(name, nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False))
        for p in self.parameters():
            p.requires_grad_(False)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        params = dict(self.named_parameters())
        if name not in params:
            raise VisionLoadError(f"vision weight {name}: not a parameter of the Vision-Exp ViT/aligner "
                                  "(a converted or different checkpoint?)")
        p = params[name]
        if tuple(tensor.shape) != tuple(p.shape):
            raise VisionLoadError(f"vision weight {name}: shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        p.data.copy_(tensor.to(p.dtype))
        self._loaded = getattr(self, "_loaded", set()) | {name}

    def missing(self) -> list[str]:
        loaded = getattr(self, "_loaded", set())
        return sorted(n for n, _ in self.named_parameters() if n not in loaded)

    @torch.no_grad()
    def image_embeddings(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int, types, perm) -> torch.Tensor:
        """One image's block: [len(types), hidden] in the text model's dtype."""
        dtype = self.image_start.dtype
        x = self.vision(patches.to(self.image_start.device, dtype), n_vit_h, n_vit_w)
        rows = self.aligner(x, n_vit_h, n_vit_w)
        vectors = {t: getattr(self, name) for t, name in SENTINELS.items()}
        return block_embeddings(ImageBlock(tuple(types), tuple(perm)), rows, vectors)

    def image_feature(self, items) -> torch.Tensor:
        """SGLang's `get_image_feature(items)`: the blocks of all items, in item order, concatenated."""
        return torch.cat([self.image_embeddings(it.feature, it.n_vit_h, it.n_vit_w, it.types, it.perm) for it in items])
