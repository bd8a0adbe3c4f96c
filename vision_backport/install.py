"""The Vision-Exp overlay's replacements at SGLang's model registry, processor map and model config (seams
`vision.model_class`, `vision.processor`, `vision.model_config` of `seams.py`), behind the experimental switch
DSV4_SM80_VISION=1, off by default. The chunk hooks live in `scheduling.py`.

- `register_model`      value of registry.ModelRegistry: "DeepseekV4ForCausalLM" -> the VL class (text-only
                        configs still get the plain text model from it).
- `register_processor`  value of multimodal_processor.PROCESSOR_MAPPING: the VL class -> the image processor.
- `mark_multimodal`     after ModelConfig.__init__: a Vision-Exp config is multimodal and image-understanding
                        (chunked prefill stays supported; piecewise prefill graphs off, as for every VLM).
The model-side hooks are `model.text_forward_with_embeds` and `routing.topk_with_vl` / `hash_topk_with_vl`.
"""

from __future__ import annotations

import functools


@functools.cache
def vl_class():
    from .model import vl_model_class

    return vl_model_class()


@functools.cache
def processor_class():
    from .processor import _processor_class

    cls = _processor_class()
    cls.models = [vl_class()]
    return cls


def register_model(registry):
    """A new registry (value seams are pure: the stock object is left as it was)."""
    import dataclasses

    return dataclasses.replace(registry, models={**registry.models, "DeepseekV4ForCausalLM": vl_class()})


def register_processor(mapping):
    return {**mapping, vl_class(): processor_class()}


def mark_multimodal(result, self, *args, **kwargs):
    from .model import is_dsv4_vision

    enable = kwargs.get("enable_multimodal", None)
    if enable is not False and is_dsv4_vision(self.hf_config):
        self.is_multimodal = True
        self.is_image_understandable_model = True
        self.is_multimodal_chunked_prefill_supported = True
        self.is_piecewise_cuda_graph_disabled_model = True
    return result
