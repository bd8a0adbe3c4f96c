"""Vision-Exp image preprocessing and the image token block, from the release's description.

- `plan(width, height, geometry)`: the pixel size an image is resized to and its ViT / LLM grids. One
  native-resolution pass, no tiles: width clamped to `max_wh_ratio` x height, small images scaled up to
  `min_pixels`, sides rounded up to the patch, then, while the block (without its alignment pad) exceeds
  `max_n_token - 3`, the aspect-preserving solver at a budget that drops by one per try.
- `pixels(image, geometry)`: a PIL image or an HxWx3 uint8 tensor -> the normalised [3, H, W] tensor
  (bicubic; a stretch for images at least `max_wh_ratio`:1 wide, otherwise a centred fit on grey 127).
- `patchify(pixels, patch)`: [3, H, W] -> [n_vit_h * n_vit_w, 3, p, p], patches row-major, each flattened
  channel-major (c, y, x) by whoever consumes it.
- `layout(n_llm_h, n_llm_w, start_pos)`: the block at an absolute prompt position: alignment pads, START,
  the grid walked by row pairs column by column (each row ends in a NEW_LINE, an odd grid gets an all-PAD
  phantom row), PADs up to a multiple of 4, END; and the aligner row each IMAGE slot takes.

Sources per convention: docs/vision.md, "Conventions and their sources".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(5)  # the release's type ids
ALIGN = 4  # the c4 compressor's stride: the grid's first token sits at a multiple of it
PIXEL_MEAN = (0.5, 0.5, 0.5)
PIXEL_STD = (0.5, 0.5, 0.5)
PAD_COLOUR = (127, 127, 127)
PLACEHOLDER = "<｜deepseek_image｜>"
PLACEHOLDER_ID = 129264  # in the stand-in tokenizer; the real tokenizer is asked at runtime
SENTINEL_BASE_ID = 129257  # vLLM's five borrowed reserved ids: base + type


@dataclass(frozen=True)
class Geometry:
    """The checkpoint's `vision_*` preprocessing fields (release values as defaults)."""

    patch: int = 14
    ratio: int = 3
    max_n_token: int = 384
    min_pixels: int = 147456
    max_wh_ratio: float = 8

    @classmethod
    def from_config(cls, config) -> Geometry:
        get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k))
        return cls(int(get("vision_patch_size")), int(get("vision_downsample_ratio")),
                   int(get("vision_max_n_token")), int(get("vision_min_pixels")), get("vision_max_wh_ratio"))


def llm_side(n_vit: int, ratio: int) -> int:
    """LLM tokens along one side: r x r patches per token, a ragged edge padded."""
    return -(-n_vit // ratio)


def grid_len(n_llm_h: int, n_llm_w: int) -> int:
    """Block length without the alignment pad: START + row pairs + trailing PADs + END."""
    body = (n_llm_h + n_llm_h % 2) * (n_llm_w + 1)
    return 1 + body + (-body) % ALIGN + 1


def _tokens_px(height: int, width: int, g: Geometry) -> int:
    return grid_len(llm_side(height // g.patch, g.ratio), llm_side(width // g.patch, g.ratio))


def _solve(height: float, width: float, budget: int, g: Geometry) -> tuple[int, int]:
    """(height, width) in pixels for a token budget: n_w from n_h * (n_w + 1) + 2 = budget with n_h / n_w
    = height / width; one LLM column when even that is under 1, two rows when the height is under 2."""
    cell = g.patch * g.ratio
    aspect = height / width
    n_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    n_h = n_w * aspect
    if n_w < 1.0:
        rows = (budget - 2) // 2
        return (rows - rows % 2) * cell, cell
    if n_h < 2.0:
        return 2 * cell, ((budget - 2) // 2 - 1) * cell
    cols, rows = math.floor(n_w), math.floor(n_h)
    rows -= rows % 2
    beta = min(cols * cell / width, rows * cell / height)
    return math.floor(height * beta / g.patch) * g.patch, math.floor(width * beta / g.patch) * g.patch


@dataclass(frozen=True)
class ImagePlan:
    width: int  # resized pixels
    height: int
    stretch: bool  # resized straight (the original is >= max_wh_ratio:1 wide), else a centred fit on grey
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int


def plan(width: int, height: int, g: Geometry = Geometry()) -> ImagePlan:
    if width <= 0 or height <= 0:
        raise ValueError(f"image {width}x{height}: both sides must be positive")
    stretch = width >= g.max_wh_ratio * height
    w, h = width, height
    if w > h * g.max_wh_ratio:  # only the width is clamped; tall images go to the solver
        w = h * g.max_wh_ratio
    if w * h < g.min_pixels:
        up = (g.min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    best_h, best_w = math.ceil(h / g.patch) * g.patch, math.ceil(w / g.patch) * g.patch
    limit = g.max_n_token - (ALIGN - 1)  # the alignment pad takes up to 3 more
    budget = limit
    # the test stays against the fixed limit; only the solver's budget shrinks
    while _tokens_px(best_h, best_w, g) > limit:
        best_h, best_w = _solve(h, w, budget, g)
        budget -= 1
    n_vit_h, n_vit_w = best_h // g.patch, best_w // g.patch
    return ImagePlan(best_w, best_h, stretch, n_vit_h, n_vit_w, llm_side(n_vit_h, g.ratio),
                     llm_side(n_vit_w, g.ratio))


def pixels(image, g: Geometry = Geometry(), dtype=None):
    """PIL image or HxWx3 uint8 tensor/array -> (normalised [3, H, W] tensor, ImagePlan). fp32 unless
    `dtype` (the release casts to BF16 here)."""
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    if not isinstance(image, Image.Image):
        arr = np.asarray(image.cpu() if isinstance(image, torch.Tensor) else image)
        if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
            raise ValueError(f"pixels: want an HxWx3 uint8 image, got {arr.dtype} {arr.shape}")
        image = Image.fromarray(np.ascontiguousarray(arr), "RGB")
    image = image.convert("RGB")
    p = plan(image.width, image.height, g)
    size = (p.width, p.height)
    if p.stretch:
        image = image.resize(size, Image.Resampling.BICUBIC)
    else:
        image = ImageOps.pad(image, size, method=Image.Resampling.BICUBIC, color=PAD_COLOUR, centering=(0.5, 0.5))
    x = torch.tensor(np.asarray(image), dtype=torch.uint8).permute(2, 0, 1).float()
    mean = torch.tensor(PIXEL_MEAN).view(3, 1, 1)
    std = torch.tensor(PIXEL_STD).view(3, 1, 1)
    x = (x / 255 - mean) / std
    return (x if dtype is None else x.to(dtype)), p


def patchify(x, patch: int):
    """[3, H, W] -> [n_vit_h * n_vit_w, 3, p, p], patches row-major over the grid."""
    import torch.nn.functional as F

    c, height, width = x.shape
    if height % patch or width % patch:
        raise ValueError(f"pixels {height}x{width}: not a whole number of {patch}-pixel patches")
    cols = F.unfold(x[None], patch, stride=patch)[0]  # [c * p * p, L]: (c, y, x) per column, L row-major
    return cols.t().reshape(-1, c, patch, patch)


@dataclass
class BlockLayout:
    start_pos: int  # absolute prompt position of the block's first token
    kinds: list[int] = field(default_factory=list)  # one type id per slot
    rows: list[int] = field(default_factory=list)  # per slot: its aligner row (row-major) if IMAGE, else -1

    def __len__(self) -> int:
        return len(self.kinds)

    @property
    def align_pad(self) -> int:
        return self.kinds.index(IMAGE_START)

    @property
    def perm(self) -> list[int]:
        """Aligner rows in the order the IMAGE slots occur."""
        return [r for r in self.rows if r >= 0]

    def token_ids(self, base: int) -> list[int]:
        """base + type per slot: the reference writes vocab_size + type, vLLM 129257 + type."""
        return [base + k for k in self.kinds]


def layout(n_llm_h: int, n_llm_w: int, start_pos: int) -> BlockLayout:
    if n_llm_h <= 0 or n_llm_w <= 0 or start_pos < 0:
        raise ValueError(f"layout: grid {n_llm_h}x{n_llm_w} at {start_pos}")
    pad = (ALIGN - 1 - start_pos) % ALIGN  # START at 3 mod 4, the grid from 0 mod 4
    out = BlockLayout(start_pos, [IMAGE_PAD] * pad + [IMAGE_START], [-1] * (pad + 1))
    row_len = n_llm_w + 1
    body = (n_llm_h + n_llm_h % 2) * row_len
    for t in range(body):
        pair, within = divmod(t, 2 * row_len)
        col, lower = divmod(within, 2)  # a pair is walked column by column, upper row first
        row = 2 * pair + lower
        if row >= n_llm_h:
            kind, arow = IMAGE_PAD, -1  # phantom row of an odd grid
        elif col == n_llm_w:
            kind, arow = IMAGE_NEW_LINE, -1
        else:
            kind, arow = IMAGE, row * n_llm_w + col
        out.kinds.append(kind)
        out.rows.append(arow)
    trail = (-body) % ALIGN  # END at 0 mod 4
    out.kinds += [IMAGE_PAD] * trail + [IMAGE_END]
    out.rows += [-1] * (trail + 1)
    return out
