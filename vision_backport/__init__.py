"""DeepSeek-V4-Flash-Vision-Exp on SGLang 0.5.16: the vision overlay (second after the A100 patch).

In progress (issue 7). Built so far and CPU-tested: the image geometry (resize plan, LLM grid, token block
layout: `image_processing.py`), the visible window (`visible_window.py`), the ViT and aligner (`vit.py`,
against an independent float64 reference). Not built yet: the VL model wrapper and its loader, bias_vl routing, the processor and chat encoding,
and the attention/scheduler wiring, so `install` still registers nothing; the gate meanwhile validates a
Vision-Exp checkpoint's vision tensors, so a converted one is refused.
"""


def install(environ=None) -> dict:
    return {"seams": 0, "note": "vision backport not implemented yet"}
