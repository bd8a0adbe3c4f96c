"""Image content in OpenAI chat messages -> DSV4 chat text with image placeholders.

The Vision-Exp release's chat encoding turns each `image_url` / `image` content block of a user message into
a text block holding exactly the placeholder `<｜deepseek_image｜>`, joins a message's content blocks with
two newlines, and collects the images in prompt order; images are accepted in user messages only, and a
literal placeholder typed into user text (or reasoning) is refused, so the n-th placeholder is always the
n-th image. The result feeds SGLang's own `encoding_dsv4.encode_messages` (text only) and then the
processor (`processor.py`), which expands each placeholder into the image's token block.
"""

from __future__ import annotations

from .processor import PLACEHOLDER, ImageRefused

IMAGE_BLOCK_TYPES = ("image_url", "image", "input_image")


def _image_ref(block: dict):
    """The image an OpenAI content block carries: a data URL, http(s) URL, local path or base64 string."""
    value = block.get(block["type"])
    if isinstance(value, dict):
        value = value.get("url") or value.get("image_url")
    if not isinstance(value, str) or not value:
        raise ImageRefused(f"an {block['type']} content block without a URL or data")
    return value


def extract_images(messages: list) -> tuple[list, list]:
    """OpenAI-format messages -> (messages whose content is plain text with placeholders, images in order)."""
    out, images = [], []
    for i, msg in enumerate(messages):
        msg = dict(msg)
        content = msg.get("content")
        for key in ("content", "reasoning_content"):
            text = msg.get(key) if isinstance(msg.get(key), str) else None
            if text and PLACEHOLDER in text:
                raise ImageRefused(f"message {i} ({msg.get('role')}): its {key} contains the image placeholder "
                                   f"{PLACEHOLDER} as text; send images as image_url content blocks")
        if isinstance(content, list):
            parts = []
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind in IMAGE_BLOCK_TYPES:
                    if msg.get("role") != "user":
                        raise ImageRefused(f"message {i} ({msg.get('role')}): images are accepted in user messages "
                                           "only")
                    images.append(_image_ref(block))
                    parts.append(PLACEHOLDER)
                elif kind == "text":
                    text = block.get("text", "")
                    if PLACEHOLDER in text:
                        raise ImageRefused(f"message {i} ({msg.get('role')}): a text block contains the image "
                                           f"placeholder {PLACEHOLDER}; send images as image_url content blocks")
                    parts.append(text)
                else:
                    raise ImageRefused(f"message {i}: content block type {kind!r} is not supported "
                                       f"(text, {', '.join(IMAGE_BLOCK_TYPES)})")
            msg["content"] = "\n\n".join(parts)
        out.append(msg)
    return out, images


def chat_with_images(original, self, request, tools, is_multimodal):
    """Around OpenAIServingChat._apply_jinja_template (serving_chat.py:863). Its DSV4 branch flattens list
    content to text and drops image blocks (:916-933). A chat with images is re-cast first: image blocks
    become the placeholder (`extract_images`), the request is re-validated with text content, the original
    renders it with SGLang's DSV4 encoding, and the images ride along as the result's image_data, in
    placeholder order, for the processor. Anything else passes through untouched."""
    if getattr(self, "chat_encoding_spec", None) != "dsv4":
        return original(self, request, tools, is_multimodal)
    messages = [m.model_dump() if hasattr(m, "model_dump") else dict(m) for m in request.messages]
    if not any(isinstance(m.get("content"), list) and any(isinstance(b, dict) and b.get("type") in IMAGE_BLOCK_TYPES
                                                          for b in m["content"]) for m in messages):
        return original(self, request, tools, is_multimodal)
    texts, images = extract_images(messages)
    data = request.model_dump()
    data["messages"] = texts
    result = original(self, type(request).model_validate(data), tools, is_multimodal)
    result.image_data = list(images)
    result.modalities = ["image"] * len(images)
    if not result.prompt and result.prompt_ids:
        # A multimodal chat reaches the tokenizer manager as `text=result.prompt` (serving_chat.py:705-718), but
        # the DSV4 branch renders only prompt_ids and leaves prompt "" (its jinja branch decodes, :1087): the
        # processor would see no prompt and no placeholder (SGLang's own VLM warmup request was refused so on
        # the H200). Decode the ids as that branch does; the processor re-encodes them.
        result.prompt = self.tokenizer_manager.tokenizer.decode(result.prompt_ids)
    return result
