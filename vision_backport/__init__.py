"""DeepSeek-V4-Flash-Vision-Exp on SGLang 0.5.16: the vision overlay (second after the A100 patch).

Not built yet (issue 7). Until then `install` registers nothing, and the gate still validates a
Vision-Exp checkpoint's vision tensors so a converted one is refused.
"""


def install(environ=None) -> dict:
    return {"seams": 0, "note": "vision backport not implemented yet"}
