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

Installed into SGLang only with the experimental switch DSV4_SM80_VISION=1: the seams of `seams.py` (this overlay's
own table, which the product's applier appends to its own), replacements in `install.py` and the modules above; with
ENABLE_SGLANG_DSV4_A100_PATCH=0 the overlay runs alone on native SGLang for A/B. What has run where:
docs/vision.md and docs/results/README.md. The gate validates a Vision-Exp checkpoint's vision tensors, so a
converted one is refused.
"""
