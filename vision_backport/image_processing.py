"""Image geometry of DeepSeek-V4-Flash-Vision-Exp: torch-free pure functions.

- `plan_image`: the pixel size an image is resized to (native resolution, one pass, no tiles): width clamped to
  `max_wh_ratio` x height, small images scaled up to `min_pixels`, sides rounded up to the patch size, then
  shrunk aspect-preserving until the image's token block fits the budget (`max_n_token` - 3: the block's
  leading alignment pad takes up to 3 more).
- `llm_grid`: the aligner's token grid for a pixel size (patches of `patch_size`, `downsample` x `downsample`
  patches per token, ragged edges padded).
- `image_block`: the token block of one image at an absolute prompt position: alignment pad so that the
  first grid token sits at a multiple of 4, START, the grid in "N-layout" (row pairs walked column by column,
  one NEW_LINE per row, a phantom all-PAD row when the row count is odd), a trailing PAD pair when needed for
  4-alignment, END. `perm[k]` is the row-major aligner row the k-th IMAGE slot takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(5)
COMPRESS_PAD_TO = 4


@dataclass(frozen=True)
class Geometry:
    """The checkpoint's vision geometry (config.json `vision_*` fields; release values as defaults)."""

    patch_size: int = 14
    downsample: int = 3
    max_n_token: int = 384
    min_pixels: int = 147456
    max_wh_ratio: int = 8

    @classmethod
    def from_config(cls, config) -> Geometry:
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        return cls(int(get("vision_patch_size")), int(get("vision_downsample_ratio")), int(get("vision_max_n_token")),
                   int(get("vision_min_pixels")), int(get("vision_max_wh_ratio")))


def llm_grid(height_px: int, width_px: int, g: Geometry = Geometry()) -> tuple[int, int]:
    return (-(-(height_px // g.patch_size) // g.downsample), -(-(width_px // g.patch_size) // g.downsample))


def grid_block_len(n_h: int, n_w: int) -> int:
    """START + the N-layout grid (rows rounded up to even, n_w + 1 slots each) + trailing pad + END."""
    rows = n_h + n_h % 2
    pad_last = 2 * ((rows // 2 * (n_w + 1)) % 2)
    return 1 + rows * (n_w + 1) + pad_last + 1


def _tokens(height_px: int, width_px: int, g: Geometry) -> int:
    return grid_block_len(*llm_grid(height_px, width_px, g))


def _fit(height: float, width: float, budget: int, g: Geometry) -> tuple[int, int]:
    """The largest aspect-preserving pixel size whose grid n_h x (n_w + 1) + 2 fits `budget`, with the
    degenerate shapes for extreme aspect ratios (one column when very tall, two rows when very wide)."""
    cell = g.patch_size * g.downsample
    ratio = height / width
    # n_h * (n_w + 1) + 2 = budget with n_h = ratio * n_w
    n_w = math.sqrt((budget - 2) / ratio + 0.25) - 0.5
    n_h = n_w * ratio
    if n_w < 1.0:
        rows = (budget - 2) // 2
        return (rows - rows % 2) * cell, cell
    if n_h < 2.0:
        return 2 * cell, ((budget - 2) // 2 - 1) * cell
    w_cells, h_cells = math.floor(n_w), math.floor(n_h)
    h_cells -= h_cells % 2
    scale = min(w_cells * cell / width, h_cells * cell / height)
    return (math.floor(height * scale / g.patch_size) * g.patch_size,
            math.floor(width * scale / g.patch_size) * g.patch_size)


@dataclass(frozen=True)
class ImagePlan:
    width: int  # resized pixels
    height: int
    stretch: bool  # True: resized straight (wider than max_wh_ratio:1); False: aspect-preserving pad to fit
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def grid_tokens(self) -> int:
        return grid_block_len(self.n_llm_h, self.n_llm_w)


def plan_image(width: int, height: int, g: Geometry = Geometry()) -> ImagePlan:
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height}: both sides must be positive")
    stretch = width >= g.max_wh_ratio * height
    w, h = float(width), float(height)
    if w > g.max_wh_ratio * h:
        w = g.max_wh_ratio * h
    if w * h < g.min_pixels:
        s = math.sqrt(g.min_pixels / (w * h))
        w, h = float(int(w * s)), float(int(h * s))
    p = g.patch_size
    best_h, best_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    # the block (alignment pad aside) must fit the fixed limit; only the solver's budget shrinks per try
    limit = budget = g.max_n_token - 3
    while _tokens(best_h, best_w, g) > limit:
        best_h, best_w = _fit(h, w, budget, g)
        budget -= 1
    n_llm_h, n_llm_w = llm_grid(best_h, best_w, g)
    return ImagePlan(best_w, best_h, stretch, best_h // p, best_w // p, n_llm_h, n_llm_w)


@dataclass(frozen=True)
class ImageBlock:
    types: tuple[int, ...]  # one slot type per token, from the block's start position on
    perm: tuple[int, ...]  # perm[k]: the row-major aligner row of the k-th IMAGE slot

    @property
    def start_offset(self) -> int:
        return self.types.index(IMAGE_START)

    def __len__(self) -> int:
        return len(self.types)


def image_block(start_pos: int, n_h: int, n_w: int) -> ImageBlock:
    """The block of an image whose first token sits at absolute prompt position `start_pos`."""
    if n_h <= 0 or n_w <= 0:
        raise ValueError(f"LLM grid {n_h}x{n_w}: both sides must be positive")
    types = [IMAGE_PAD] * ((COMPRESS_PAD_TO - 1) - start_pos % COMPRESS_PAD_TO)
    types.append(IMAGE_START)
    perm = []
    rows = n_h + n_h % 2
    for top in range(0, rows, 2):
        for col in range(n_w + 1):
            for row in (top, top + 1):
                if row >= n_h:
                    types.append(IMAGE_PAD)  # the phantom row of an odd grid
                elif col == n_w:
                    types.append(IMAGE_NEW_LINE)
                else:
                    types.append(IMAGE)
                    perm.append(row * n_w + col)
    types.extend([IMAGE_PAD] * (2 * ((rows // 2 * (n_w + 1)) % 2)))
    types.append(IMAGE_END)
    return ImageBlock(tuple(types), tuple(perm))


def image_patches(image, g: Geometry = Geometry()):
    """A PIL image -> (patches BF16 [n_vit_h * n_vit_w, 3, p, p] row-major over the grid, its ImagePlan).

    RGB; resized to the plan: straight (a stretch) when the original is max_wh_ratio:1 wide or wider,
    otherwise an aspect-preserving bicubic fit centred on grey (127, 127, 127); then x / 255, (x - 0.5) / 0.5
    per channel (range [-1, 1]), BF16."""
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    image = image.convert("RGB")
    plan = plan_image(image.width, image.height, g)
    size = (plan.width, plan.height)
    if plan.stretch:
        image = image.resize(size, Image.BICUBIC)
    else:
        image = ImageOps.pad(image, size, method=Image.BICUBIC, color=(127, 127, 127))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)  # [3, H, W]
    x = (x / 255.0 - 0.5) / 0.5
    p = g.patch_size
    x = x.reshape(3, plan.n_vit_h, p, plan.n_vit_w, p).permute(1, 3, 0, 2, 4)
    return x.reshape(plan.n_vit_h * plan.n_vit_w, 3, p, p).to(torch.bfloat16), plan


def block_embeddings(block: ImageBlock, aligner_rows, vectors):
    """The embeddings of a whole block, one row per slot: the k-th IMAGE slot takes aligner row perm[k]
    (row-major over the LLM grid); START / PAD / NEW_LINE / END slots take their learned vectors
    (`vectors`: {IMAGE_START: image_start, IMAGE_PAD: image_pad, IMAGE_NEW_LINE: image_newline,
    IMAGE_END: image_end}, each [hidden])."""
    import torch

    if aligner_rows.shape[0] != len(block.perm):
        raise ValueError(f"{aligner_rows.shape[0]} aligner rows for a block with {len(block.perm)} image slots")
    types = torch.tensor(block.types, device=aligner_rows.device)
    table = torch.zeros(5, aligner_rows.shape[1], dtype=aligner_rows.dtype, device=aligner_rows.device)
    for t, v in vectors.items():
        table[t] = v.to(table.dtype)
    out = table[types]
    out[types == IMAGE] = aligner_rows[torch.tensor(block.perm, device=aligner_rows.device)]
    return out
