"""Vision-Exp request processing: image checks, placeholder expansion, the SGLang processor, chat content."""

import asyncio
import base64
import io
import types

import pytest

from vision_backport import processor as P
from vision_backport.chat import extract_images
from vision_backport.image_processing import IMAGE, IMAGE_START, Geometry, plan_image


def png(width, height, color=(200, 30, 30)):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw):
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def test_images_decoded_and_refused_with_the_check_named(tmp_path):
    from PIL import Image

    assert P.load_and_check(data_url(png(640, 480)), 0).size == (640, 480)
    path = tmp_path / "a.png"
    path.write_bytes(png(300, 200))
    assert P.load_and_check(str(path), 0).size == (300, 200)
    assert P.load_and_check(Image.new("L", (100, 100)), 0).mode == "RGB"
    assert P.load_and_check(data_url(png(800, 100)), 0).size == (800, 100)  # exactly 8:1 is accepted
    refusals = {
        "corrupt": ("data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode(),
                    "image 3: cannot be decoded"),
        "missing file": (str(tmp_path / "nope.png"), "image 3: cannot be decoded"),
        "too wide": (data_url(png(900, 100)),
                     "image 3: aspect ratio 9.0:1 (900x100) is beyond the model's vision_max_wh_ratio 8:1"),
        "too tall": (data_url(png(100, 1000)), "image 3: aspect ratio 10.0:1 (100x1000)"),
        "zero size": (Image.new("RGB", (0, 5)), "image 3: size 0x5; both sides must be positive"),
    }
    for data, msg in refusals.values():
        with pytest.raises(P.ImageRefused, match=msg.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            P.load_and_check(data, 3)
    assert issubclass(P.ImageRefused, ValueError)  # SGLang answers ValueErrors with 400


def test_huge_image_refused(monkeypatch):
    monkeypatch.setattr(P, "MAX_PIXELS", 1000 * 1000)
    with pytest.raises(P.ImageRefused, match=r"1200x1000 = 1,200,000 pixels; at most 1,000,000"):
        P.load_and_check(data_url(png(1200, 1000)), 0)


def test_expand_prompt_places_aligned_blocks():
    from PIL import Image

    ph = 99
    sizes = [(640, 480), (100, 750), (756, 756)]
    imgs = [Image.new("RGB", s, (10, 20, 30)) for s in sizes]
    ids = [0, 2, 5, ph, 7, 8, ph, 9, ph, 3]
    out, blocks = P.expand_prompt(ids, imgs, ph)
    assert len(blocks) == 3
    assert len(out) == len(ids) - 3 + sum(len(b.block) for b in blocks)
    text = [t for i, t in enumerate(out) if not any(b.start <= i <= b.end for b in blocks)]
    assert text == [0, 2, 5, 7, 8, 9, 3]
    for b, (w, h) in zip(blocks, sizes):
        plan = plan_image(w, h)
        assert all(t == ph for t in out[b.start:b.end + 1])
        first_grid = b.start + b.block.types.index(IMAGE_START) + 1
        assert first_grid % 4 == 0  # the grid starts 4-aligned, whatever precedes the image
        assert b.block.types.count(IMAGE) == len(b.block.perm) == plan.n_llm_h * plan.n_llm_w
        assert tuple(b.patches.shape) == (plan.n_vit_h * plan.n_vit_w, 3, 14, 14)
        assert (b.n_vit_h, b.n_vit_w) == (plan.n_vit_h, plan.n_vit_w)
    with pytest.raises(P.ImageRefused, match="the prompt has 3 image placeholder.s. for 2 image.s."):
        P.expand_prompt(ids, imgs[:2], ph)
    with pytest.raises(P.ImageRefused, match="3 images in one request; at most 2"):
        P.expand_prompt(ids, imgs, ph, max_images=2)


def test_chat_content_to_placeholders():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is in"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
                                         {"type": "text", "text": "and"},
                                         {"type": "image_url", "image_url": {"url": "/tmp/b.png"}}]},
            {"role": "assistant", "content": "A cat."}]
    out, images = extract_images(msgs)
    assert images == ["data:image/png;base64,AAA", "/tmp/b.png"]
    assert out[1]["content"] == f"What is in\n\n{P.PLACEHOLDER}\n\nand\n\n{P.PLACEHOLDER}"
    assert out[0] == msgs[0] and out[2] == msgs[2]
    bad = [
        ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "message 0 .assistant.: images are accepted in user messages only"),
        ([{"role": "user", "content": f"look {P.PLACEHOLDER}"}], "its content contains the image placeholder"),
        ([{"role": "user", "content": [{"type": "text", "text": P.PLACEHOLDER}]}],
         "a text block contains the image placeholder"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "without a URL or data"),
        ([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}],
         "'video_url' is not supported"),
    ]
    for m, msg in bad:
        with pytest.raises(P.ImageRefused, match=msg):
            extract_images(m)


@pytest.mark.sglang
def test_sglang_processor_end_to_end(tmp_path):
    """The processor class on SGLang 0.5.16's base, with the stand-in tokenizer and SGLang's own DSV4 chat
    encoding: a two-image chat becomes ids with both blocks and two image items."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from sglang.srt.entrypoints.openai import encoding_dsv4
    from transformers import AutoTokenizer

    from dsv4_sm80.checkpoint import format as fmt
    from dsv4_sm80.tiny.tokenizer import write_tokenizer

    write_tokenizer(str(tmp_path), 129280)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.convert_tokens_to_ids(P.PLACEHOLDER) == P.PLACEHOLDER_ID
    server_args = types.SimpleNamespace(keep_mm_feature_on_device=False, mm_feature_transport="cpu",
                                        disable_fast_image_processor=False, skip_tokenizer_init=False,
                                        mm_process_config={})
    hf_config = types.SimpleNamespace(**fmt.vision_exp_config())
    proc = P._processor_class()(hf_config, server_args, tok, None)
    msgs, images = extract_images([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(640, 480))}},
        {"type": "text", "text": "Compare with"},
        {"type": "image_url", "image_url": {"url": data_url(png(200, 900, (0, 0, 255)))}}]}])
    prompt = encoding_dsv4.encode_messages(msgs, thinking_mode="chat")
    assert prompt.count(P.PLACEHOLDER) == 2
    out = asyncio.run(proc.process_mm_data_async(image_data=images, audio_data=None, input_text=prompt,
                                                 request_obj=None, max_req_input_len=100000))
    assert out.im_token_id == P.PLACEHOLDER_ID and len(out.mm_items) == 2
    for item, (w, h) in zip(out.mm_items, [(640, 480), (200, 900)]):
        plan = plan_image(w, h)
        (start, end), = item.offsets
        assert all(t == P.PLACEHOLDER_ID for t in out.input_ids[start:end + 1])
        assert item.n_vit_h == plan.n_vit_h and len(item.perm) == plan.n_llm_h * plan.n_llm_w
        assert len(item.types) == end - start + 1 and str(item.feature.dtype) == "torch.bfloat16"
    assert out.input_ids[0] == 0 and tok.decode(out.input_ids[-3:]).endswith("<｜Assistant｜></think>")
    # the same through an id prompt (the tokenizer manager may pass ids)
    ids = tok.encode(prompt, add_special_tokens=False)
    again = asyncio.run(proc.process_mm_data_async(image_data=images, input_text=ids, request_obj=None))
    assert again.input_ids == out.input_ids
    with pytest.raises(P.ImageRefused, match="image 0: cannot be decoded"):
        asyncio.run(proc.process_mm_data_async(image_data=["data:image/png;base64,AAAA"], input_text=ids,
                                               request_obj=None))
    assert Geometry.from_config(hf_config) == Geometry()


def test_block_hash_covers_the_layout():
    """Same pixels and grid at another 4-alignment: another block (leading pads), so another hash."""
    from PIL import Image

    img = Image.new("RGB", (640, 480), (1, 2, 3))
    _, (a,) = P.expand_prompt([5, 99], [img], 99)
    _, (b,) = P.expand_prompt([5, 6, 99], [img], 99)
    _, (c,) = P.expand_prompt([7, 99], [img], 99)
    ha, hb, hc = (P.block_hash(x.patches, x.n_vit_h, x.n_vit_w, x.block.start_offset) for x in (a, b, c))
    assert a.block.start_offset != b.block.start_offset and ha != hb
    assert ha == hc  # the text before does not matter, only the alignment it leaves
    other = P.expand_prompt([5, 99], [Image.new("RGB", (640, 480), (1, 2, 4))], 99)[1][0]
    assert P.block_hash(other.patches, other.n_vit_h, other.n_vit_w, other.block.start_offset) != ha
    assert 0 <= ha < 2 ** 63


@pytest.mark.sglang
def test_openai_chat_keeps_images(tmp_path):
    """The vision.chat hook on SGLang's real ChatCompletionRequest: a DSV4 chat with images reaches the
    renderer as text with placeholders, and the result carries the images in order; other requests and
    other encodings pass through untouched."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, MessageProcessingResult

    from vision_backport.chat import chat_with_images

    seen = []

    def original(self, request, tools, is_multimodal):
        seen.append([m.model_dump() for m in request.messages])
        return MessageProcessingResult(prompt="rendered", prompt_ids=[1], image_data=[], video_data=[], audio_data=[],
                                       modalities=[], stop=[])

    dsv4, other = types.SimpleNamespace(chat_encoding_spec="dsv4"), types.SimpleNamespace(chat_encoding_spec=None)
    url_a, url_b = data_url(png(64, 64)), data_url(png(32, 64))
    req = ChatCompletionRequest(model="x", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": url_a}},
                                     {"type": "image_url", "image_url": {"url": url_b}}]}])
    out = chat_with_images(original, dsv4, req, None, True)
    assert out.image_data == [url_a, url_b] and out.modalities == ["image", "image"]
    assert seen[-1][0]["content"] == f"Compare\n\n{P.PLACEHOLDER}\n\n{P.PLACEHOLDER}"
    plain = ChatCompletionRequest(model="x", messages=[{"role": "user", "content": "Hi"}])
    assert chat_with_images(original, dsv4, plain, None, True).image_data == [] and seen[-1][0]["content"] == "Hi"
    assert chat_with_images(original, other, req, None, True).image_data == []  # not DSV4: untouched
    bad = ChatCompletionRequest(model="x", messages=[{"role": "user", "content": [
        {"type": "text", "text": P.PLACEHOLDER}, {"type": "image_url", "image_url": {"url": url_a}}]}])
    with pytest.raises(P.ImageRefused, match="a text block contains the image placeholder"):
        chat_with_images(original, dsv4, bad, None, True)


@pytest.mark.sglang
def test_openai_chat_with_an_image_through_sglangs_dsv4_renderer(tmp_path):
    """SGLang's own _apply_jinja_template (the DSV4 branch: encoding_dsv4, the stand-in tokenizer) under the
    hook, with the request SGLang's server warmup sends a VLM: the prompt text a multimodal chat is sent
    with (serving_chat passes `text=prompt` for multimodal models) holds exactly one placeholder, and the
    processor's expansion of it succeeds. Without the decode the prompt was "" and the warmup was refused
    with "0 image placeholder(s) for 1 image(s)" on the H200."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from PIL import Image
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    from dsv4_sm80.tiny.tokenizer import write_tokenizer
    from vision_backport.chat import chat_with_images

    write_tokenizer(str(tmp_path), 129280)
    tok = get_tokenizer(str(tmp_path))
    chat = object.__new__(OpenAIServingChat)  # the real class; only what its DSV4 branch reads is set
    chat.chat_encoding_spec = "dsv4"
    chat.tokenizer_manager = types.SimpleNamespace(tokenizer=tok)
    chat.template_manager = types.SimpleNamespace(jinja_template_content_format="string")
    url = data_url(png(64, 64))
    warmup = ChatCompletionRequest(model="x", max_tokens=8, temperature=0.0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]}])
    out = chat_with_images(OpenAIServingChat._apply_jinja_template, chat, warmup, None, True)
    assert out.image_data == [url] and out.prompt.count(P.PLACEHOLDER) == 1, out.prompt
    ids = tok.encode(out.prompt, add_special_tokens=False)  # what the processor does with the text
    assert ids == out.prompt_ids
    expanded, blocks = P.expand_prompt(ids, [Image.new("RGB", (640, 480), (200, 10, 10))], P.PLACEHOLDER_ID)
    assert len(blocks) == 1 and expanded.count(P.PLACEHOLDER_ID) == len(blocks[0].block)
