"""The Vision-Exp model class on a GPU: SGLang's own ModelRunner loads the tiny `--vision` checkpoint through
the VL class (registered in this process only: it is not registered by the overlay yet), then checks that
every vision weight and every layer's bias_vl arrived as stored, and that the image feature of processed
images has one finite row per block slot.

    ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB_GPU_COUNT=1 DSV4_SM80_LAB_CC=9.0 \
        python -m dsv4_lab.beds.vision_check --out vision.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default="/tmp/dsv4-tiny-vl")
    args = ap.parse_args(argv)

    import torch
    from PIL import Image
    from safetensors.torch import load_file

    from dsv4_sm80.tiny.generate import ensure

    ensure(args.ckpt, vision=True, head_scale=12.0)
    from sglang.srt.models.registry import ModelRegistry

    from dsv4_lab.beds.dense_check import build_runner
    from vision_backport.image_processing import Geometry
    from vision_backport.model import vl_model_class
    from vision_backport.processor import expand_prompt

    cls = vl_model_class()
    ModelRegistry.models["DeepseekV4ForCausalLM"] = cls
    runner = build_runner(args.ckpt, 0.5)
    model = runner.model
    record = {"class": type(model).__module__ + "." + type(model).__qualname__, "checks": {}}
    ok = isinstance(model, cls)
    stored = {}
    for shard in sorted(glob.glob(os.path.join(args.ckpt, "*.safetensors"))):
        stored.update(load_file(shard))
    params = dict(model.vision_part.named_parameters())
    vision_equal = all(torch.equal(params[n].float().cpu(), stored[n].float()) for n in params)
    record["checks"]["vision weights as stored"] = vision_equal
    bias_ok = []
    for i, layer in enumerate(model.model.layers):
        p = getattr(layer.mlp.gate, "e_score_correction_bias_vl", None)
        want = stored.get(f"layers.{i}.ffn.gate.bias_vl")
        bias_ok.append(p is not None and want is not None and torch.equal(p.float().cpu(), want.float()))
    record["checks"]["bias_vl loaded on every layer"] = all(bias_ok)
    config = json.load(open(os.path.join(args.ckpt, "config.json")))
    g = Geometry.from_config(config)
    imgs = [Image.new("RGB", (640, 480), (220, 20, 20)), Image.new("RGB", (120, 700), (20, 20, 220))]
    _, blocks = expand_prompt([0, 2, 99, 5, 99], imgs, 99, g)
    feats = model.get_image_feature(blocks)  # the expanded blocks are items
    record["checks"]["image feature: one finite row per slot"] = bool(
        feats.shape == (sum(len(b.block) for b in blocks), config["hidden_size"]) and torch.isfinite(feats).all())
    record["feature_shape"] = list(feats.shape)
    ok &= all(record["checks"].values())
    print(f"vision_check: {torch.cuda.get_device_name(0)} model {record['class']}")
    for k, v in record["checks"].items():
        print(f"  {'OK  ' if v else 'FAIL'} {k}")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("vision_check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
