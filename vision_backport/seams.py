"""The Vision-Exp overlay's seam table: every SGLang 0.5.16 internal it replaces, declared as the product declares
its own (`dsv4_sm80.seams.Seam`, overlay "vision": only with DSV4_SM80_VISION=1, with the patch on or off) and applied
by the product's one applier after the product's table, so on a shared target these wrap the product's seams
(`vision.sm80_window` wraps `attention.forward`). The replacements live in this package.
"""

from __future__ import annotations

from dsv4_sm80.seams import Seam


def _vision(**fields) -> Seam:
    return Seam(overlay="vision", **fields)


VISION_SEAMS: tuple[Seam, ...] = (
    _vision(
        name="vision.model_class",
        target="sglang.srt.models.registry:ModelRegistry",
        kind="value",
        replacement="vision_backport.install:register_model",
        reason=("Stock 0.5.16 dies on a Vision-Exp checkpoint (KeyError: aligner.gate_up_proj) and would drop "
                "image content; the VL class loads the vision weights and embeds images."),
        upstream="srt/models/registry.py:130",
    ),
    _vision(
        name="vision.processor",
        target="sglang.srt.managers.multimodal_processor:PROCESSOR_MAPPING",
        kind="value",
        replacement="vision_backport.install:register_processor",
        reason="Images of a request become each image's token block and patches.",
        upstream="srt/managers/multimodal_processor.py:13",
    ),
    _vision(
        name="vision.model_config",
        target="sglang.srt.configs.model_config:ModelConfig.__init__",
        kind="after",
        replacement="vision_backport.install:mark_multimodal",
        reason="0.5.16 does not know DeepseekV4ForCausalLM can be multimodal (model_config.py:414).",
        upstream="srt/configs/model_config.py:232",
    ),
    _vision(
        name="vision.text_embeds",
        target="sglang.srt.models.deepseek_v4:DeepseekV4Model.forward",
        kind="around",
        replacement="vision_backport.model:text_forward_with_embeds",
        reason=("DeepseekV4Model.forward ignores input_embeds (deepseek_v4.py:2259); the multimodal routine "
                "passes the image embeddings that way, and the routing needs the image mask."),
        upstream="srt/models/deepseek_v4.py:2250",
    ),
    _vision(
        name="vision.chat",
        target="sglang.srt.entrypoints.openai.serving_chat:OpenAIServingChat._apply_jinja_template",
        kind="around",
        replacement="vision_backport.chat:chat_with_images",
        reason=("The DSV4 chat branch flattens content lists and drops image blocks (serving_chat.py:916); "
                "images become placeholders and image_data instead."),
        upstream="srt/entrypoints/openai/serving_chat.py:863",
    ),
    _vision(
        name="vision.topk",
        target="sglang.srt.layers.moe.topk:TopK.forward_cuda",
        kind="around",
        replacement="vision_backport.routing:topk_with_vl",
        reason="Image-block tokens choose experts with bias_vl, text tokens with the correction bias.",
        upstream="srt/layers/moe/topk.py:484",
    ),
    _vision(
        name="vision.hash_topk",
        target="sglang.srt.layers.moe.hash_topk:HashTopK.forward",
        kind="around",
        replacement="vision_backport.routing:hash_topk_with_vl",
        reason=("Hash layers route image tokens by bias_vl instead of the token table, which an image pad "
                "value would index out of range."),
        upstream="srt/layers/moe/hash_topk.py:180",
    ),
    _vision(
        name="vision.whole_image_blocks",
        target="sglang.srt.managers.schedule_batch:Req.set_extend_range",
        kind="around",
        replacement="vision_backport.scheduling:set_extend_range_whole_blocks",
        reason=("Every prefill chunk cut goes through Req.set_extend_range; a cut inside an image block moves "
                "to the block's start (or past its end when the block is longer than the chunk), so a block's "
                "bidirectional queries always run in one forward."),
        upstream="srt/managers/schedule_batch.py:1153-1154",
    ),
    _vision(
        name="vision.whole_block_unchunks",
        target="sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req",
        kind="around",
        replacement="vision_backport.scheduling:add_req_unchunked_when_whole",
        reason=("When vision.whole_image_blocks moves a chunk's cut to the prompt's end, the request is no longer "
                "chunked; SGLang flagged it from its own cut and would schedule an empty extend next round."),
        upstream="srt/managers/schedule_policy.py:1001-1185",
    ),
    _vision(
        name="vision.whole_block_unchunks_ignore_eos",
        target="sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req_ignore_eos",
        kind="around",
        replacement="vision_backport.scheduling:add_req_unchunked_when_whole",
        reason="The same for SGLang's ignore_eos admission path.",
        upstream="srt/managers/schedule_policy.py:887-999",
    ),
    _vision(
        name="vision.whole_block_ends_chunking",
        target="sglang.srt.managers.schedule_policy:PrefillAdder.add_chunked_req",
        kind="around",
        replacement="vision_backport.scheduling:add_chunked_req_unchunked_when_whole",
        reason=("The same for a later chunk: a chunk moved to the prompt's end is the last one, whatever SGLang's "
                "own cut said."),
        upstream="srt/managers/schedule_policy.py:830-870",
    ),
    _vision(
        name="vision.sm80_window",
        target="sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.forward",
        kind="around",
        replacement="vision_backport.window:sm80_forward_with_window",
        reason=("Image-block queries of a prefill attend to their whole block both ways (the Vision-Exp window): "
                "the SM80 forward (attention.forward, declared before this) reads the widened SWA lists."),
        upstream="srt/layers/attention/deepseek_v4_backend.py:1600-1755",
        when=("ENABLE_SGLANG_DSV4_A100_PATCH=1",),
    ),
    _vision(
        name="vision.native_window",
        target="sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.forward",
        kind="around",
        replacement="vision_backport.window:native_forward_with_window",
        reason=("Native A/B (patch off): image-block queries of a prefill get the bidirectional window in "
                "FlashMLA's SWA index lists (vision.sm80_window gives the SM80 forward the same lists)."),
        upstream="srt/layers/attention/deepseek_v4_backend.py:1600-1755",
        when=("ENABLE_SGLANG_DSV4_A100_PATCH=0",),
    ),
)
