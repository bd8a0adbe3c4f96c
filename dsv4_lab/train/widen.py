"""The served shape: a checkpoint with every query head copied `factor` times, an exact transform.

Native SGLang 0.5.16 at TP1 decodes through FlashMLA's sparse kernel, which takes 64 or 128 query heads, and
pads a rank's heads to 64 only when tp_size > 1 (`sglang/srt/models/deepseek_v4.py:1109-1115`). The trained
model has 16 heads (a quarter of the attention's training cost); it is served with 64.

Head h becomes heads factor*h .. factor*h + factor-1. A group of `o_groups` is a contiguous run of heads, so
each copy stays in its source's group. In the official format (FP8 e4m3 128 x 128 blocks, UE8M0 scales):
- `attn.wq_b` rows (and their 128-row scale blocks) are copied: each copy's query is its source's.
- `attn.attn_sink` is copied.
- `attn.wo_a` columns are copied and divided by `factor`: FP8 codes unchanged, each UE8M0 exponent lowered by
  log2(factor) (a 128-column block lies inside one head's 512 columns).
Attention is per head (per-head query norm, softmax with its sink), so each copy's output equals its
source's, and wo_a sums factor copies of o * w / factor. No other tensor depends on the head count (the
indexer has heads of its own). The FP8 activation rounding before wo_a works per 128 columns, inside one
head, so it sees the same values too. `mtp.*` stages get the same transform.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import OrderedDict

import torch

from dsv4_sm80.checkpoint import format as fmt
from dsv4_sm80.checkpoint.safetensors_io import write_shard

SERVED_HEADS = 64
_WQ_B = re.compile(r"\.attn\.wq_b\.(weight|scale)$")
_WO_A = re.compile(r"\.attn\.wo_a\.(weight|scale)$")
_SINK = re.compile(r"\.attn\.attn_sink$")


class WidenError(ValueError):
    pass


def served_config(cfg: dict, heads: int = SERVED_HEADS) -> OrderedDict:
    """The config with `heads` query heads (a multiple of the trained count)."""
    have = int(cfg["num_attention_heads"])
    if heads % have:
        raise WidenError(f"widen: {heads} heads is not a multiple of the checkpoint's {have}; expected "
                         f"{have} x an integer")
    out = OrderedDict(cfg)
    out["num_attention_heads"] = heads
    return out


def _heads_copy(t: torch.Tensor, heads: int, factor: int, dim: int) -> torch.Tensor:
    """t with its `dim` split into `heads` equal parts, each repeated `factor` times in place."""
    shape = list(t.shape)
    split = shape[:dim] + [heads, shape[dim] // heads] + shape[dim + 1:]
    out = t.reshape(split).repeat_interleave(factor, dim=dim)
    return out.reshape(shape[:dim] + [shape[dim] * factor] + shape[dim + 1:])


def _lower_e8m0(scale: torch.Tensor, steps: int, name: str) -> torch.Tensor:
    raw = scale.view(torch.uint8)
    if int(raw.min()) < steps or int(raw.max()) == 255:
        raise WidenError(f"widen: {name} holds UE8M0 exponents {int(raw.min())}..{int(raw.max())}; expected "
                         f"{steps}..254 to divide by 2^{steps} exactly")
    return (raw - steps).view(scale.dtype)


def widen_tensor(name: str, t: torch.Tensor, heads: int, groups: int, factor: int) -> torch.Tensor:
    """The served tensor `name` from the trained one (unchanged unless it holds per-head rows or columns).
    wq_b's rows are all heads' queries; wo_a's columns are one group's heads (its rows stack the groups)."""
    if _SINK.search(name):
        return t.repeat_interleave(factor)
    if _WQ_B.search(name):
        return _heads_copy(t, heads, factor, 0)
    if _WO_A.search(name):
        wide = _heads_copy(t, heads // groups, factor, 1)
        if name.endswith(".scale"):
            return _lower_e8m0(wide, factor.bit_length() - 1, name)
        return wide
    return t


def widen(src: str, dst: str, heads: int = SERVED_HEADS) -> str:
    """Write the checkpoint in src with `heads` query heads into dst (replaced if present); returns dst."""
    from safetensors import safe_open

    cfg = json.load(open(os.path.join(src, "config.json")), object_pairs_hook=OrderedDict)
    have = int(cfg["num_attention_heads"])
    wide = served_config(cfg, heads)
    factor, groups = heads // have, int(cfg["o_groups"])
    if factor & (factor - 1):
        raise WidenError(f"widen: factor {factor} is not a power of two; UE8M0 scales divide exactly only by 2^k")
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    wm = index["weight_map"]
    tmp = dst + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(src, f), os.path.join(tmp, f))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(wide, f, indent=2)
        f.write("\n")
    specs = fmt.inventory(wide)
    n_shards = fmt.shard_count(wide)
    by_shard: dict[int, list] = {}
    for s in specs:
        by_shard.setdefault(s.shard, []).append(s)
    weight_map, total = OrderedDict(), 0
    handles = {}
    try:
        for shard in range(1, n_shards + 1):
            shard_name = fmt.shard_name(shard, n_shards)
            tensors = []
            for s in by_shard[shard]:
                if s.name not in wm:
                    raise WidenError(f"widen: {s.name} is not in {src}; expected a checkpoint of the official format")
                fname = wm[s.name]
                if fname not in handles:
                    handles[fname] = safe_open(os.path.join(src, fname), "pt")
                t = widen_tensor(s.name, handles[fname].get_tensor(s.name), have, groups, factor)
                if tuple(t.shape) != tuple(s.shape):
                    raise WidenError(f"widen: {s.name} came out {tuple(t.shape)}; the served format expects "
                                     f"{tuple(s.shape)}")
                data = t.contiguous().view(torch.uint8).numpy().tobytes()
                tensors.append((s.name, s.dtype, s.shape, data))
                weight_map[s.name] = shard_name
                total += len(data)
            write_shard(os.path.join(tmp, shard_name), tensors)
    finally:
        handles.clear()
    meta = dict(index.get("metadata", {}), total_size=total, dsv4_lab_trained_heads=have)
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": meta, "weight_map": weight_map}, f, indent=2)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst
