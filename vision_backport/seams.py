"""The Vision-Exp overlay's seam table: every SGLang 0.5.16 internal it replaces, declared as the product declares
its own (`dsv4_sm80.seams.Seam`, overlay "vision": only with DSV4_SM80_VISION=1, with the patch on or off) and applied
by the product's one applier after the product's table, so on a shared target these wrap the product's seams
(`vision.sm80_window` wraps `attention.forward`). The replacements live in this package.
"""

from __future__ import annotations

from dsv4_sm80.seams import Seam


def _vision(name: str, target: str, kind: str, replacement: str, upstream: str, *when_then_reason: str) -> Seam:
    """vision.`name` on sglang.srt.`target`, replaced by vision_backport.`replacement`; the last argument is the
    reason, any before it are toggles besides DSV4_SM80_VISION=1."""
    *when, reason = when_then_reason
    return Seam(name=f"vision.{name}", target=f"sglang.srt.{target}", kind=kind,
                replacement=f"vision_backport.{replacement}", reason=reason, upstream=upstream, when=tuple(when),
                overlay="vision")


VISION_SEAMS: tuple[Seam, ...] = (
    _vision("model_class", "models.registry:ModelRegistry",
            "value", "install:register_model", "srt/models/registry.py:130",
            "Stock 0.5.16 dies on a Vision-Exp checkpoint (KeyError: aligner.gate_up_proj) and would drop image "
            "content; the VL class loads the vision weights and embeds images."),
    _vision("processor", "managers.multimodal_processor:PROCESSOR_MAPPING",
            "value", "install:register_processor", "srt/managers/multimodal_processor.py:13",
            "Images of a request become each image's token block and patches."),
    _vision("model_config", "configs.model_config:ModelConfig.__init__",
            "after", "install:mark_multimodal", "srt/configs/model_config.py:232",
            "0.5.16 does not know DeepseekV4ForCausalLM can be multimodal (model_config.py:414)."),
    _vision("text_embeds", "models.deepseek_v4:DeepseekV4Model.forward",
            "around", "model:text_forward_with_embeds", "srt/models/deepseek_v4.py:2250",
            "DeepseekV4Model.forward ignores input_embeds (deepseek_v4.py:2259); the multimodal routine passes the "
            "image embeddings that way, and the routing needs the image mask."),
    _vision("chat", "entrypoints.openai.serving_chat:OpenAIServingChat._apply_jinja_template",
            "around", "chat:chat_with_images", "srt/entrypoints/openai/serving_chat.py:863",
            "The DSV4 chat branch flattens content lists and drops image blocks (serving_chat.py:916); images become "
            "placeholders and image_data instead."),
    _vision("topk", "layers.moe.topk:TopK.forward_cuda", "around", "routing:topk_with_vl", "srt/layers/moe/topk.py:484",
            "Image-block tokens choose experts with bias_vl, text tokens with the correction bias."),
    _vision("hash_topk", "layers.moe.hash_topk:HashTopK.forward",
            "around", "routing:hash_topk_with_vl", "srt/layers/moe/hash_topk.py:180",
            "Hash layers route image tokens by bias_vl instead of the token table, which an image pad value would "
            "index out of range."),
    _vision("whole_image_blocks", "managers.schedule_batch:Req.set_extend_range",
            "around", "scheduling:set_extend_range_whole_blocks", "srt/managers/schedule_batch.py:1153-1154",
            "Every prefill chunk cut goes through Req.set_extend_range; a cut inside an image block moves to the "
            "block's start (or past its end when the block is longer than the chunk), so a block's bidirectional "
            "queries always run in one forward."),
    _vision("whole_block_unchunks", "managers.schedule_policy:PrefillAdder.add_one_req",
            "around", "scheduling:add_req_unchunked_when_whole", "srt/managers/schedule_policy.py:1001-1185",
            "When vision.whole_image_blocks moves a chunk's cut to the prompt's end, the request is no longer "
            "chunked; SGLang flagged it from its own cut and would schedule an empty extend next round."),
    _vision("whole_block_unchunks_ignore_eos", "managers.schedule_policy:PrefillAdder.add_one_req_ignore_eos",
            "around", "scheduling:add_req_unchunked_when_whole", "srt/managers/schedule_policy.py:887-999",
            "The same for SGLang's ignore_eos admission path."),
    _vision("whole_block_ends_chunking", "managers.schedule_policy:PrefillAdder.add_chunked_req",
            "around", "scheduling:add_chunked_req_unchunked_when_whole", "srt/managers/schedule_policy.py:830-870",
            "The same for a later chunk: a chunk moved to the prompt's end is the last one, whatever SGLang's own cut "
            "said."),
    _vision("sm80_window", "layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.forward",
            "around", "window:sm80_forward_with_window", "srt/layers/attention/deepseek_v4_backend.py:1600-1755",
            "ENABLE_SGLANG_DSV4_A100_PATCH=1",
            "Image-block queries of a prefill attend to their whole block both ways (the Vision-Exp window): the SM80 "
            "forward (attention.forward, declared before this) reads the widened SWA lists."),
    _vision("native_window", "layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.forward",
            "around", "window:native_forward_with_window", "srt/layers/attention/deepseek_v4_backend.py:1600-1755",
            "ENABLE_SGLANG_DSV4_A100_PATCH=0",
            "Native A/B (patch off): image-block queries of a prefill get the bidirectional window in FlashMLA's SWA "
            "index lists (vision.sm80_window gives the SM80 forward the same lists)."),
)
