"""The Vision-Exp part of the VL wrapper: weight split, loading from a real-format checkpoint, and the image
block embeddings SGLang's multimodal routine scatters over a block (against a slot-by-slot reference)."""

import glob
import os

import pytest
import torch

from conftest import REPO
from vision_backport import model as M
from vision_backport.image_processing import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START


def checkpoint_tensors(ckpt):
    from safetensors.torch import load_file

    for shard in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        yield from load_file(shard).items()


@pytest.fixture(scope="module")
def part(unit_vision_ckpt):
    import json

    config = json.load(open(os.path.join(unit_vision_ckpt, "config.json")))
    p = M.VisionPart(config)
    text = list(M.split_vision_weights(checkpoint_tensors(unit_vision_ckpt), p.load))
    return p, config, text


def test_split_and_load(part, unit_vision_ckpt):
    p, config, text = part
    assert M.is_dsv4_vision(config)
    assert not M.is_dsv4_vision(dict(config, vision_n_layers=0))
    assert not any(n.startswith(("vision.", "aligner.", "image_")) for n, _ in text)
    assert any(n.endswith(".ffn.gate.bias_vl") for n, _ in text)  # routing bias goes to the text model
    assert p.missing() == []
    names = {n for n, _ in p.named_parameters()}
    assert {"image_start", "image_pad", "image_newline", "image_end", "aligner.w1.weight"} <= names
    assert p.vision.norm.weight.dtype == torch.float32 and p.aligner.w1.weight.dtype == torch.bfloat16
    got = dict(checkpoint_tensors(unit_vision_ckpt))
    assert torch.equal(p.image_newline.data, got["image_newline"])
    assert torch.equal(p.vision.norm.weight.data, got["vision.norm.weight"].float())
    fresh = M.VisionPart(config)
    with pytest.raises(M.VisionLoadError, match="vision weight vision.extra: not a parameter"):
        fresh.load("vision.extra", torch.zeros(1))
    with pytest.raises(M.VisionLoadError, match=r"vision weight image_pad: shape \(3,\), expected"):
        fresh.load("image_pad", torch.zeros(3))
    assert "image_pad" in fresh.missing()


def test_block_embeddings_slot_by_slot(part):
    from PIL import Image

    from vision_backport.processor import expand_prompt

    p, config, _ = part
    from vision_backport.image_processing import Geometry

    g = Geometry.from_config(config)
    imgs = [Image.new("RGB", (500, 300), (200, 10, 10)), Image.new("RGB", (150, 700), (10, 10, 200))]
    ids, blocks = expand_prompt([1, 7, 99, 5, 99], imgs, 99, g)
    feats = p.image_feature(blocks)  # the expanded blocks are items
    assert feats.shape == (sum(len(b.block) for b in blocks), config["hidden_size"])
    assert feats.dtype == torch.bfloat16
    row = 0
    for b in blocks:
        with torch.no_grad():
            aligned = p.aligner(p.vision(b.patches, b.n_vit_h, b.n_vit_w), b.n_vit_h, b.n_vit_w)
        j = 0
        for t in b.block.types:
            want = {IMAGE_START: p.image_start, IMAGE_PAD: p.image_pad, IMAGE_NEW_LINE: p.image_newline,
                    IMAGE_END: p.image_end}.get(t)
            if t == IMAGE:
                want = aligned[b.block.perm[j]]
                j += 1
            assert torch.equal(feats[row], want.to(feats.dtype)), (row, t)
            row += 1
        assert j == len(b.block.perm)
    # a different image changes the image rows and only them
    other = expand_prompt([1, 7, 99, 5, 99], [Image.new("RGB", (500, 300), (0, 200, 0)), imgs[1]], 99, g)[1]
    feats2 = p.image_feature(other)
    types0 = torch.tensor(blocks[0].block.types)
    first = slice(0, len(blocks[0].block))
    assert not torch.equal(feats[first][types0 == IMAGE], feats2[first][types0 == IMAGE])
    assert torch.equal(feats[first][types0 != IMAGE], feats2[first][types0 != IMAGE])
    assert torch.equal(feats[len(blocks[0].block):], feats2[len(blocks[0].block):])


INSTALLED = """
import json, sys
sys.path.insert(0, {root!r})
from transformers import AutoTokenizer
from sglang.srt.server_args import ServerArgs
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.managers.multimodal_processor import PROCESSOR_MAPPING, get_mm_processor
out = {{}}
for name, path in (("vision", {vckpt!r}), ("text", {tckpt!r})):
    sa = ServerArgs(model_path=path, device="cpu", skip_tokenizer_init=True)
    mc = ModelConfig.from_server_args(sa)
    cls, _ = ModelRegistry.resolve_model_cls(mc.hf_config.architectures)
    rec = dict(multimodal=bool(mc.is_multimodal), image=bool(mc.is_image_understandable_model),
               cls=cls.__module__ + "." + cls.__qualname__)
    if mc.is_multimodal:
        proc = get_mm_processor(mc.hf_config, sa, AutoTokenizer.from_pretrained(path), None, model_config=mc)
        rec["processor"] = type(proc).__name__
        rec["placeholder"] = proc.placeholder_id
    out[name] = rec
print(json.dumps(out))
"""


@pytest.mark.sglang
@pytest.mark.parametrize("vision", ["1", "0"])
def test_installed_with_the_experimental_switch(unit_vision_ckpt, unit_ckpt, vision):
    """DSV4_SM80_VISION=1: a Vision-Exp config is multimodal, resolves to the VL class and gets the image
    processor; a text config stays text (the VL class hands it the plain text model). Off (the default):
    nothing changes."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from conftest import last_json, run_python

    root = REPO
    out = last_json(run_python(INSTALLED.format(root=root, vckpt=unit_vision_ckpt, tckpt=unit_ckpt),
                               ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_VISION=vision))
    stock, vl = "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM", "vision_backport.model.DeepseekV4ForCausalLM"
    assert out["text"] == {"multimodal": False, "image": False, "cls": vl if vision == "1" else stock}
    if vision == "1":
        assert out["vision"] == {"multimodal": True, "image": True,
                                 "cls": "vision_backport.model.DeepseekV4ForCausalLM",
                                 "processor": "DeepseekV4VLImageProcessor", "placeholder": 129264}
    else:
        assert out["vision"] == {"multimodal": False, "image": False, "cls": stock}


def test_extend_image_spans():
    types = [IMAGE_PAD, IMAGE_PAD, IMAGE_START, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE_END]
    item = lambda a: type("I", (), dict(offsets=[(a, a + len(types) - 1)], types=types))  # noqa: E731
    mm = lambda *items: type("MM", (), dict(mm_items=list(items)))  # noqa: E731
    # request 0: one block inside the extend; request 1: no images; request 2: a block cached before the extend
    spans = M.extend_image_spans([mm(item(10)), None, mm(item(3))], [0, 0, 20], [30, 5, 8])
    assert spans == [[(12, 16)], [], []]
    with pytest.raises(M.PartialImageBlock, match=r"image block \[12, 16\] is split by this prefill chunk \[0, 14\)"):
        M.extend_image_spans([mm(item(10))], [0], [14])


@pytest.mark.sglang
def test_visible_window_lists_against_brute_force():
    """SGLang's own causal SWA lists, widened by the SM80 forward for image queries, equal the brute-force
    visible window (vision_backport.visible_window) mapped through req_to_token and full_to_swa; text
    queries keep SGLang's list exactly."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from sglang.kernels.ops.attention.dsv4_attn_metadata_kernels import build_causal_swa_page_indices

    from vision_backport.visible_window import visible_windows
    from vision_backport.window import visible_swa_lists

    g = torch.Generator().manual_seed(0)
    ctx, pool = 1200, 5000
    req_to_token = torch.stack([torch.randperm(pool, generator=g)[:ctx] for _ in range(3)]).to(torch.int32)
    full_to_swa = torch.randperm(pool, generator=g).to(torch.int64)
    full_to_swa[-1] = -1
    # two requests in one extend: prefix 0 / 700, extend 900 / 250; spans inside each extend
    prefix, ext, rows = [0, 700], [900, 250], torch.tensor([2, 0])
    spans = [[(40, 420), (600, 610)], [(760, 900)]]
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, ext)])
    rep = torch.repeat_interleave(rows, torch.tensor(ext))
    causal = build_causal_swa_page_indices(req_to_token=req_to_token, full_to_swa_mapping=full_to_swa,
                                           req_pool_indices_repeated=rep, seq_lens_casual=positions + 1,
                                           swa_window=128, page_index_aligned_size=64)
    lens = torch.clamp(positions + 1, max=128).to(torch.int32)
    ids, new_lens = visible_swa_lists(causal, lens, spans, positions, ext, rows, req_to_token, full_to_swa)
    assert ids.shape == (sum(ext), 512) and ids.dtype == causal.dtype
    t = 0
    for r, (p0, n) in enumerate(zip(prefix, ext)):
        starts, lengths = visible_windows(p0 + n, spans[r])
        for pos in range(p0, p0 + n):
            in_image = any(s <= pos <= e for s, e in spans[r])
            want = {int(full_to_swa[req_to_token[rows[r], x]]) for x in range(starts[pos], starts[pos] + lengths[pos])}
            got = {int(x) for x in ids[t, : int(new_lens[t])] if x >= 0}
            assert got == want - {-1}, (r, pos)
            if not in_image:
                assert torch.equal(ids[t, :128], causal[t, :128]) and int(new_lens[t]) == int(lens[t])
                assert (ids[t, 128:] == -1).all()
            t += 1


@pytest.mark.sglang
def test_forward_places_images_only_in_extends(monkeypatch):
    """A decode or verify batch keeps its requests' mm_inputs (contains_mm_inputs() is true) but has no extend
    lengths: the VL forward hands it to the text forward, as SGLang's general_mm_embed_routine does. On the
    H200 the first decode after an image prefill died in extend_image_spans(extend_prefix_lens_cpu=None)."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    def batch(mode, mm=True):
        return SimpleNamespace(forward_mode=mode, contains_mm_inputs=lambda: mm, mm_inputs=[object()],
                               extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None)

    places = {m.name for m in ForwardMode if M.embeds_images(batch(m))}
    assert {"EXTEND", "MIXED"} <= places
    assert not places & {"DECODE", "TARGET_VERIFY"}
    assert not any(M.embeds_images(batch(m, mm=False)) for m in ForwardMode)

    cls = M.vl_model_class()
    text = cls.__mro__[1]
    seen = []
    monkeypatch.setattr(text, "forward", lambda self, ids, pos, fb, *rest: seen.append(fb.forward_mode.name) or "text")
    vl = object.__new__(cls)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        ids = torch.zeros(2, dtype=torch.long)
        assert cls.forward(vl, ids, torch.zeros(2, dtype=torch.long), batch(mode)) == "text"
    assert seen == ["DECODE", "TARGET_VERIFY"]
