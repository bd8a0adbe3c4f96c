"""Vision-Exp request processing: images -> patches, prompt placeholders ->
each image's token block, for SGLang 0.5.16's multimodal pipeline.

- `load_and_check`: decode one image (data URL, local path, base64, bytes, PIL) through SGLang's own
  `load_image`, then refuse what the model cannot take, with a message naming the check: undecodable bytes,
  zero size, more pixels than `MAX_PIXELS`, an aspect ratio beyond the checkpoint's `vision_max_wh_ratio`
  (either orientation: the reference would silently stretch a wider image and squeeze a taller one into one
  token column), more images than `max_images` per request. Raised as `ImageRefused` (a ValueError: SGLang's
  HTTP layer answers 400 and keeps serving).
- `expand_prompt`: the prompt ids with each placeholder replaced by its image's block (`image_block` at the
  absolute position, so its alignment pad depends on what precedes it), filled with the placeholder id, and
  one `MultimodalDataItem` per image: patches BF16 [n_vit_h * n_vit_w, 3, 14, 14], offsets of the whole block,
  and (types, perm, n_vit_h, n_vit_w) for the model.
- `DeepseekV4VLImageProcessor`: the `BaseMultimodalProcessor` SGLang calls (`process_mm_data_async`), for text
  or id prompts; registered for the VL model class by the seam vision.processor (DSV4_SM80_VISION=1).
"""

from __future__ import annotations

from dataclasses import dataclass

from .image_processing import Geometry, ImageBlock, image_block, image_patches

PLACEHOLDER = "<｜deepseek_image｜>"
PLACEHOLDER_ID = 129264  # in the Vision-Exp tokenizer; resolved from the tokenizer at runtime
MAX_PIXELS = 64 * 1024 * 1024  # decoded pixels per image; far above anything the 384-token budget keeps
MAX_IMAGES = 16


class ImageRefused(ValueError):
    """A request image the server will not process; the message names the image and the check."""


def load_and_check(data, index: int, g: Geometry = Geometry()):
    """One request image -> an RGB PIL image, or ImageRefused."""
    from PIL import Image

    try:
        if isinstance(data, Image.Image):
            img = data
        else:
            from sglang.srt.utils import load_image

            img = load_image(data, gpu_image_decode=False)
            img = img[0] if isinstance(img, tuple) else img
        if not isinstance(img, Image.Image):
            raise TypeError(f"decoded to {type(img).__name__}, not an image")
        width, height = img.size
    except ImageRefused:
        raise
    except Exception as e:  # PIL, base64, missing file, decompression bomb: all "cannot decode"
        raise ImageRefused(f"image {index}: cannot be decoded ({type(e).__name__}: {str(e)[:200]}); "
                           "send a PNG/JPEG/WebP as a data URL, base64 or a local file path") from None
    if width <= 0 or height <= 0:
        raise ImageRefused(f"image {index}: size {width}x{height}; both sides must be positive")
    if width * height > MAX_PIXELS:
        raise ImageRefused(f"image {index}: {width}x{height} = {width * height:,} pixels; at most {MAX_PIXELS:,} "
                           "are accepted (the model sees at most 756x756 of it anyway): downscale it")
    ratio = max(width / height, height / width)
    if ratio > g.max_wh_ratio:
        raise ImageRefused(f"image {index}: aspect ratio {ratio:.1f}:1 ({width}x{height}) is beyond the model's "
                           f"vision_max_wh_ratio {g.max_wh_ratio}:1; crop or split it")
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:
        raise ImageRefused(f"image {index}: cannot be decoded ({type(e).__name__}: {str(e)[:200]})") from None


@dataclass
class ExpandedImage:
    start: int  # absolute position of the block's first token
    block: ImageBlock
    patches: object  # torch BF16 [n_vit_h * n_vit_w, 3, p, p]
    n_vit_h: int
    n_vit_w: int

    @property
    def end(self) -> int:  # inclusive, as SGLang's offsets
        return self.start + len(self.block) - 1

    # what VisionPart.image_feature reads of an item (SGLang's MultimodalDataItem carries the same names)
    @property
    def feature(self):
        return self.patches

    @property
    def types(self):
        return self.block.types

    @property
    def perm(self):
        return self.block.perm


def expand_prompt(ids: list[int], images: list, placeholder_id: int, g: Geometry = Geometry(),
                  max_images: int = MAX_IMAGES) -> tuple[list[int], list[ExpandedImage]]:
    """ids with one placeholder per image -> ids with each placeholder replaced by its block (filled with the
    placeholder id), and the blocks. `images` are checked PIL images, in prompt order."""
    slots = [i for i, t in enumerate(ids) if t == placeholder_id]
    if len(images) > max_images:
        raise ImageRefused(f"{len(images)} images in one request; at most {max_images} are accepted")
    if len(slots) != len(images):
        raise ImageRefused(f"the prompt has {len(slots)} image placeholder(s) for {len(images)} image(s); each "
                           "image content block must become exactly one placeholder")
    out, expanded, prev = [], [], 0
    for slot, img in zip(slots, images):
        out.extend(ids[prev:slot])
        patches, plan = image_patches(img, g)
        block = image_block(len(out), plan.n_llm_h, plan.n_llm_w)
        expanded.append(ExpandedImage(len(out), block, patches, plan.n_vit_h, plan.n_vit_w))
        out.extend([placeholder_id] * len(block))
        prev = slot + 1
    out.extend(ids[prev:])
    return out, expanded


def block_hash(patches, n_vit_h: int, n_vit_w: int, lead_pads: int) -> int:
    """The item's hash (SGLang derives the block's pad value and the embedding cache key from it): the pixels
    plus the layout. The same image at another 4-alignment has a different leading pad and so a different
    block; hashing the pixels alone would let the embedding cache hand one layout's rows to the other."""
    import hashlib

    import torch

    digest = hashlib.sha256(patches.contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(f"{n_vit_h}x{n_vit_w}+{lead_pads}".encode())
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def _processor_class():
    """Built lazily: importing SGLang's processor base pulls in torch and transformers."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalProcessorOutput
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor

    class DeepseekV4VLImageProcessor(BaseMultimodalProcessor):
        models: list = []  # filled by the VL wrapper's registration

        def __init__(self, hf_config, server_args, _processor, *args, **kwargs):
            super().__init__(hf_config, server_args, _processor, *args, **kwargs)
            self.geometry = Geometry.from_config(hf_config)
            tok_id = self._tokenizer.convert_tokens_to_ids(PLACEHOLDER)
            self.placeholder_id = tok_id if isinstance(tok_id, int) and tok_id >= 0 else PLACEHOLDER_ID
            self.max_images = int(self.image_config.get("max_images", MAX_IMAGES))

        async def process_mm_data_async(self, image_data=None, audio_data=None, input_text=None,
                                        request_obj=None, **kwargs):
            if not image_data:
                return None
            images = image_data if isinstance(image_data, list) else [image_data]
            if len(images) > self.max_images:
                raise ImageRefused(f"{len(images)} images in one request; at most {self.max_images} are accepted")
            checked = [load_and_check(getattr(d, "url", d), i, self.geometry) for i, d in enumerate(images)]
            if isinstance(input_text, str):  # rendered prompt text: BOS and specials are already in it
                ids = self._tokenizer.encode(input_text, add_special_tokens=False)
            else:
                ids = list(input_text)
            ids, blocks = expand_prompt(ids, checked, self.placeholder_id, self.geometry, self.max_images)
            items = [MultimodalDataItem(modality=Modality.IMAGE, feature=b.patches, offsets=[(b.start, b.end)],
                                        hash=block_hash(b.patches, b.n_vit_h, b.n_vit_w, b.block.start_offset),
                                        model_specific_data={"types": list(b.block.types),
                                                             "perm": list(b.block.perm),
                                                             "n_vit_h": b.n_vit_h, "n_vit_w": b.n_vit_w})
                     for b in blocks]
            return MultimodalProcessorOutput(mm_items=items, input_ids=ids, im_token_id=self.placeholder_id)

    return DeepseekV4VLImageProcessor
