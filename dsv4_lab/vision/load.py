"""The oracle of an official-format Vision-Exp checkpoint: transformers' text model exactly dequantized
(`dsv4_lab.oracle.load`), its bias_vl (`text.load_bias_vl`) and the image tower (`tower.Tower`), all fp32."""

from __future__ import annotations

import glob
import json
import os

from .text import load_bias_vl
from .tower import Tower

VISION_PREFIXES = ("vision.", "aligner.", "image_")


def vision_key(key: str, hash_layers: int) -> bool:
    """Keys the text library does not read (official or library spelling): the tower's, bias_vl, and the hash
    layers' unused gate.bias."""
    if key.startswith(VISION_PREFIXES) or key.endswith(".gate.bias_vl"):
        return True
    return any(key in (f"layers.{i}.ffn.gate.bias", f"layers.{i}.mlp.gate.e_score_correction_bias")
               for i in range(hash_layers))


def load_vl_reference(ckpt: str, device: str = "cpu"):
    """(text model with bias_vl, tower) of a Vision-Exp checkpoint, fp32, eval mode."""
    from safetensors import safe_open

    from dsv4_lab.oracle.load import ReferenceLoadError, load_reference

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    if int(cfg.get("vision_n_layers") or 0) <= 0:
        raise ReferenceLoadError(f"vision oracle load: {ckpt!r} has no vision_n_layers > 0; expected a "
                                 "Vision-Exp checkpoint")
    hash_layers = int(cfg.get("num_hash_layers") or 0)
    model = load_reference(ckpt, device, read_elsewhere=lambda k: vision_key(k, hash_layers))
    tensors = {}
    for shard in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        with safe_open(shard, "pt") as f:
            for k in f.keys():
                if vision_key(k, hash_layers) and not k.startswith("mtp."):
                    tensors[k] = f.get_tensor(k)
    load_bias_vl(model, {k: v for k, v in tensors.items() if k.endswith(".gate.bias_vl")})
    tower = Tower(cfg)
    own = {k: v for k, v in tensors.items() if k.startswith(VISION_PREFIXES)}
    missing = sorted(set(tower.state_dict()) - set(own))
    extra = sorted(set(own) - set(tower.state_dict()))
    if missing or extra:
        raise ReferenceLoadError(f"vision oracle load: {ckpt!r} lacks {missing[:3]} / has unknown {extra[:3]}; "
                                 "expected the Vision-Exp tower's tensors exactly")
    tower.load_state_dict({k: v.float() for k, v in own.items()})
    return model, tower.float().to(device).eval()
