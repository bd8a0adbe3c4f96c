"""DeepSeek-V4-Flash-Vision-Exp on SGLang 0.5.16: the vision overlay (applied after the SM80 patch).

What it holds, each CPU-tested: the image geometry and pixels (resize plan, LLM grid, token block layout,
patches, block embeddings: `image_processing.py`), the visible window and the atomic chunk / prefix boundaries
(`visible_window.py`), the ViT and aligner (`vit.py`, against an independent float64 reference), the bias_vl
routing and its hooks at SGLang's TopK / HashTopK (`routing.py`), request processing (`processor.py`: image
decoding and refusals, placeholder -> token block expansion, the SGLang processor class), image content in
chat messages (`chat.py`), the VL model (`model.py`: SGLang's DSV4 class subclassed, bias_vl parameters, the
vision weight split, ViT + aligner + sentinels loaded from the checkpoint, the multimodal forward, `input_embeds`
for the text model), the bidirectional image window in the attention (`window.py`: the VL forward records each
extend's image blocks, `extend_image_spans`, and the window seams widen those queries' SWA lists to the whole
block on the SM80 forward and on native FlashMLA alike), and prefill chunks cut only at image-block edges
(`scheduling.py`, at `Req.set_extend_range`; a split block still reaching the forward is refused with a
message, not attended wrongly).

Installed into SGLang only with the experimental switch DSV4_SM80_VISION=1 (the `vision.*` seams of
`dsv4_sm80/seams.py`, replacements in `install.py` and the modules above); with ENABLE_SGLANG_DSV4_A100_PATCH=0
the overlay runs alone on native SGLang for A/B. Nothing of it has run on a GPU: the switch stays experimental.
The gate meanwhile validates a Vision-Exp checkpoint's vision tensors, so a converted one is refused.
"""


def install(environ=None) -> dict:
    """Called by the bootstrap after the SM80 patch. The vision replacements are applied by the one seam
    mechanism (the `vision.*` seams, toggled by DSV4_SM80_VISION); this reports the switch."""
    from dsv4_sm80 import env

    on = env.get(env.VISION, environ) == "1"
    return {"switch": f"{env.VISION.name}={'1' if on else '0'}",
            "note": "experimental: not yet run on a GPU" if on else "not installed"}
