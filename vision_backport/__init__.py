"""DeepSeek-V4-Flash-Vision-Exp on SGLang 0.5.16: the vision overlay (second after the A100 patch).

In progress (issue 7). Built so far and CPU-tested: the image geometry and pixels (resize plan, LLM grid,
token block layout, patches, block embeddings: `image_processing.py`), the visible window and the atomic
chunk / prefix boundaries (`visible_window.py`), the ViT and
aligner (`vit.py`, against an independent float64 reference), the bias_vl routing function (`routing.py`),
request processing (`processor.py`: image decoding and refusals, placeholder -> token block expansion, the
SGLang processor class), image content in chat messages (`chat.py`), and the wrapper's vision part
(`model.py`: the weight split the text loader needs, ViT + aligner + sentinels loaded from the checkpoint,
the block embeddings for SGLang's `get_image_feature`), the VL model class (`vl_model_class`: SGLang's DSV4
class subclassed, bias_vl parameters, the vision weight split, the multimodal forward, `input_embeds` for the
text model) and the bias_vl hooks for SGLang's TopK / HashTopK (`routing.py`; checked on SGLang's own top-k).
Not built yet: the installation of all of this into SGLang (model registry, processor mapping,
`is_multimodal`, the TopK / HashTopK / DeepseekV4Model.forward hooks, the serving_chat hook), the
bidirectional image window in the attention, the scheduler hooks for atomic image blocks; so `install` still
registers nothing (serving images without the window would be silently wrong). The gate meanwhile validates
a Vision-Exp checkpoint's vision tensors, so a converted one is refused.
"""


def install(environ=None) -> dict:
    return {"seams": 0, "note": "vision backport not implemented yet"}
