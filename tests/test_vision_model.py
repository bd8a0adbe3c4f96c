"""The Vision-Exp part of the VL wrapper: weight split, loading from a real-format checkpoint, and the image
block embeddings SGLang's multimodal routine scatters over a block (against a slot-by-slot reference)."""

import glob
import os

import pytest
import torch

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
    items = [type("Item", (), dict(feature=b.patches, n_vit_h=b.n_vit_h, n_vit_w=b.n_vit_w,
                                   types=list(b.block.types), perm=list(b.block.perm))) for b in blocks]
    feats = p.image_feature(items)
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
    items2 = [type("Item", (), dict(feature=b.patches, n_vit_h=b.n_vit_h, n_vit_w=b.n_vit_w,
                                    types=list(b.block.types), perm=list(b.block.perm))) for b in other]
    feats2 = p.image_feature(items2)
    types0 = torch.tensor(blocks[0].block.types)
    first = slice(0, len(blocks[0].block))
    assert not torch.equal(feats[first][types0 == IMAGE], feats2[first][types0 == IMAGE])
    assert torch.equal(feats[first][types0 != IMAGE], feats2[first][types0 != IMAGE])
    assert torch.equal(feats[len(blocks[0].block):], feats2[len(blocks[0].block):])
