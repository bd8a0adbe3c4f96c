"""Tiny checkpoints in the official DeepSeek-V4-Flash-0731 (and -Vision-Exp) format.

Same names, key order, dtypes, shape formulas, shard layout, index and config field names as the
real checkpoint (`dsv4_sm80.checkpoint.format`), at small widths. Every tensor
is drawn from its own RNG seeded by (seed, name), so a file is reproducible and identical for any
TP size. The fixture of every test and the default model of `serve` in lab mode.
"""

from __future__ import annotations

import fcntl
import json
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..checkpoint import format as fmt
from ..checkpoint.safetensors_io import write_shard
from .quant import fp8_block_quantize, mxfp4_quantize

WEIGHT_STD = 0.02  # N(0, 0.02) linears, biases 0, norms 1
HC_STD = 0.01
# bias_vl is not zero, unlike the other biases: image rows must then choose other experts than text rows would,
# so a routing trace can tell the two rules apart (0.1: the order of the tiny router's score spread)
BIAS_VL_STD = 0.1
# The LM-head scale that makes a preset's next-token distributions peaked like the GPU bed's tiny model: logits
# have std sqrt(hidden) * WEIGHT_STD * scale over a unit-RMS final state, 5.4 for the tiny preset at 12; the wide
# and full presets (hidden 4096) get that std at 12 * sqrt(512 / 4096). At 1.0 the wide checkpoint gave logit std
# 1.3, top-1 log-probability -6.9, 143 confident positions of 7000 (a parity measure with little to hold).
PEAKED_HEAD_SCALE = {"tiny": 12.0, "unit": 12.0, "wide": round(12.0 * (512 / 4096) ** 0.5, 3),
                     "full": round(12.0 * (512 / 4096) ** 0.5, 3)}


def head_scale_for(preset: str, asked: float | None) -> float:
    """The head scale a GPU bed generates or expects: the one asked for, else the preset's peaked one."""
    return PEAKED_HEAD_SCALE[preset] if asked is None else asked


@dataclass(frozen=True)
class TinySize:
    hidden: int = 512
    layers: int = 5
    heads: int = 64  # FlashMLA takes 64 or 128 query heads per rank: 64 for TP1
    o_groups: int = 8
    q_lora: int = 256
    o_lora: int = 256
    moe_inter: int = 512
    experts: int = 16
    vocab: int = 129280
    markov_rank: int = 256


PRESETS = {
    # The GPU test bed's model (hidden 512, 5 layers, 64 heads, 16 experts; ~0.5 GB).
    "tiny": TinySize(),
    # CPU unit tests: small vocab and widths (~20 MB), same layer pattern.
    "unit": TinySize(hidden=256, heads=64, o_groups=8, q_lora=128, o_lora=128, moe_inter=128,
                     experts=8, vocab=1024, markov_rank=64),
    # DSV4-Flash widths (hidden 4096, 64 heads, q/o LoRA 1024, 256 experts of 2048) with the fewest
    # layers that still hold SWA, C4, C128 and hash layers: the real per-rank shapes for end-to-end
    # benchmarks. ~24 GB with the DSPARK stages; generate with fast_experts (random MXFP4 codes).
    "wide": TinySize(hidden=4096, layers=4, heads=64, o_groups=8, q_lora=1024, o_lora=1024, moe_inter=2048,
                     experts=256, vocab=129280, markov_rank=256),
    # DSV4-Flash's depth (43 layers: the release's SWA / C4 / C128 pattern, 3 hash layers, DSPARK on 40-42) at ONE
    # TP4 rank's widths, served at TP1: 16 query heads and 2 output groups (64 and 8 over 4), expert and shared
    # intermediate 512 (2048 over 4), vocabulary 32,320 (the vocab-parallel head's and embedding's share); hidden,
    # LoRA ranks, the indexer and all 256 experts as released. At TP1 it holds what one real TP4 rank holds, byte
    # for byte, but the hash layers' tid2eid and DSPARK's markov_w1, whole on a real rank and a quarter here (57 MB
    # less; a step reads only its tokens' rows of them); a decode step reads the rank's bytes and runs no
    # collective. 43 GB on disk; 38.9 GiB main + 2.7 GiB draft resident (bf16 dense). docs/performance.md.
    "full": TinySize(hidden=4096, layers=43, heads=16, o_groups=2, q_lora=1024, o_lora=1024, moe_inter=512,
                     experts=256, vocab=32320, markov_rank=256),
}
# presets whose routed experts get random MXFP4 codes (quantizing N(0, 0.02) draws would take minutes per layer)
FAST_EXPERT_PRESETS = ("wide", "full")

VISION_TINY = OrderedDict([
    # ViT head_dim 64 and rope_dim 32 as in the real model; patch, merge and pixel bounds real so
    # the processor and sentinel alignment are exercised.
    ("vision_n_layers", 2), ("vision_dim", 128), ("vision_n_heads", 2), ("vision_inter_dim", 256),
    ("vision_patch_size", 14), ("vision_rope_theta", 10000.0), ("vision_downsample_ratio", 3),
    ("vision_max_n_token", 384), ("vision_min_pixels", 147456), ("vision_max_wh_ratio", 8),
])


MIN_VOCAB = 270  # tiny.tokenizer: 14 special tokens + 256 byte tokens


class TinyConfigError(ValueError):
    pass


def tiny_config(size: TinySize = TinySize(), vision: bool = False) -> OrderedDict:
    """0731's config.json with only the width fields changed, same key order."""
    s = size
    problems = []
    if s.hidden % 128:
        problems.append(f"hidden {s.hidden} % 128 != 0 (FP8 128x128 blocks, Marlin tiles)")
    if s.layers < 4:
        problems.append(f"layers {s.layers} < 4 (need SWA, C4 and C128 layers and a C4 hash layer)")
    if (s.heads * 512) % s.o_groups or (s.heads * 512 // s.o_groups) % 128:
        problems.append(f"heads*512/o_groups = {s.heads * 512 / s.o_groups} must be a multiple of 128")
    if s.q_lora % 128 or s.o_lora % 128:
        problems.append("q_lora and o_lora must be multiples of 128")
    if s.moe_inter % 128:
        problems.append(f"moe_inter {s.moe_inter} % 128 != 0")
    if s.experts < 6:
        problems.append(f"experts {s.experts} < num_experts_per_tok 6")
    if vision and s.vocab < 129262:
        problems.append(f"vocab {s.vocab} with --vision: a vision checkpoint keeps the real vocabulary (image "
                        "placeholder ids 129257-129261); pass --vocab 129280")
    elif s.vocab < MIN_VOCAB:
        problems.append(f"vocab {s.vocab} < {MIN_VOCAB} (the stand-in tokenizer's special tokens and 256 bytes)")
    if problems:
        raise TinyConfigError("; ".join(problems))
    cfg = fmt.vision_exp_config() if vision else fmt.flash_0731_config()
    for key in list(fmt.VISION_EXP_FIELDS):
        cfg.pop(key, None)
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, s.layers)]
    cfg.update(
        hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        o_groups=s.o_groups, q_lora_rank=s.q_lora, o_lora_rank=s.o_lora,
        moe_intermediate_size=s.moe_inter, n_routed_experts=s.experts, vocab_size=s.vocab,
        compress_ratios=ratios + [0, 0, 0],
        dspark_target_layer_ids=[s.layers - 3, s.layers - 2, s.layers - 1],
        dspark_markov_rank=s.markov_rank,
        dspark_noise_token_id=min(128799, s.vocab - 1),
    )
    if vision:
        cfg.update(VISION_TINY)
    return cfg


def _rng(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _fill(spec: fmt.TensorSpec, seed: int, head_scale: float, vocab: int, experts: int) -> torch.Tensor:
    torch_dtype = {"BF16": torch.bfloat16, "F32": torch.float32}.get(spec.dtype)
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=torch_dtype)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=torch_dtype)
    if spec.init == "tid2eid":  # k distinct experts per token id
        k = spec.shape[1]
        t = torch.arange(vocab, dtype=torch.int64).unsqueeze(1)
        return (t * 7 + torch.arange(k)) % experts
    std = {"normal": WEIGHT_STD, "head": WEIGHT_STD * head_scale, "hc_fn": HC_STD, "bias_vl": BIAS_VL_STD}[spec.init]
    w = torch.randn(spec.shape, generator=_rng(seed, spec.name), dtype=torch.float32) * std
    return w.to(torch_dtype)


def _random_mxfp4(spec: fmt.TensorSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes and E8M0 exponents 2^-8..2^-6 (|w| mostly below 0.05, like N(0, 0.02) quantized),
    without drawing and quantizing fp32 weights: seconds instead of minutes per full-width layer."""
    n, k = _dense_shape(spec)
    g = _rng(seed, spec.name)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    return packed, torch.randint(119, 122, (n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)


def head_scale_of(out_dir: str):
    """The LM-head scale a generated checkpoint was written with (its index's metadata); None if not recorded."""
    with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
        return json.load(f).get("metadata", {}).get("dsv4_sm80_head_scale")


def ensure(out_dir: str, preset: str = "tiny", vision: bool = False, **kw) -> str:
    """out_dir, generated from the preset first when it holds no checkpoint (the GPU scripts' first use);
    keyword arguments go to `generate`. Processes started at once (one per GPU) generate it once: the first
    holds a lock beside out_dir while it writes, the others wait and then find the index it wrote last.
    An existing checkpoint written with another head_scale than asked for is refused (a comparison on flat
    outputs where peaked ones were meant says little and looks fine)."""
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        _check_head_scale(out_dir, kw.get("head_scale"))
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.abspath(out_dir) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(index):
            generate(out_dir, tiny_config(PRESETS[preset], vision=vision), **kw)
    _check_head_scale(out_dir, kw.get("head_scale"))
    return out_dir


def _check_head_scale(out_dir: str, wanted) -> None:
    if wanted is None:
        return
    have = head_scale_of(out_dir)
    if have is not None and abs(float(have) - float(wanted)) > 1e-6:
        raise TinyConfigError(f"checkpoint head scale: {out_dir} was generated with head_scale {have}, this run asks "
                              f"for {wanted}; remove the folder to regenerate it, or ask for {have}")


def generate(out_dir: str, config, seed: int = 0, head_scale: float = 1.0, log=print,
             fast_experts: bool = False, tokenizer: bool = True, progress=None, weights=None) -> dict:
    """Write config.json, the shards and model.safetensors.index.json into out_dir, and (tokenizer=True) the
    stand-in tokenizer of `tiny.tokenizer`. fast_experts: routed experts get random MXFP4 codes instead of
    quantized N(0, 0.02) draws (for full-width checkpoints). progress(tensors done, tensors, bytes done) is
    called after each tensor. weights: {official name: full-precision tensor} for every weight of the
    inventory (scales excluded), written instead of the seeded draws: FP8 and MXFP4 weights are quantized
    here, the others cast to their dtype (a trained model's export)."""
    specs = fmt.inventory(config)
    if weights is not None:
        _check_given(specs, weights)
    n_shards = fmt.shard_count(config)
    vocab, experts = int(config["vocab_size"]), int(config["n_routed_experts"])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    weight_map, total, by_shard = OrderedDict(), 0, {}
    for s in specs:
        by_shard.setdefault(s.shard, []).append(s)
    for shard in range(1, n_shards + 1):
        name = fmt.shard_name(shard, n_shards)
        tensors, pending_scale = [], {}
        for s in by_shard[shard]:
            if s.init == "pair":
                data = pending_scale.pop(s.name)
            elif weights is not None and s.init in ("fp8", "mxfp4"):
                w = weights[s.name].detach().float().cpu()
                q, scale = fp8_block_quantize(w) if s.init == "fp8" else mxfp4_quantize(w)
                data = _raw(q)
                pending_scale[s.name[: -len(".weight")] + ".scale"] = _raw(scale)
            elif weights is not None:
                data = _raw(_given(s, weights[s.name]))
            elif s.init == "mxfp4" and fast_experts:
                q, scale = _random_mxfp4(s, seed)
                data = _raw(q)
                pending_scale[s.name[: -len(".weight")] + ".scale"] = _raw(scale)
            elif s.init in ("fp8", "mxfp4"):
                w = torch.randn(_dense_shape(s), generator=_rng(seed, s.name)) * WEIGHT_STD
                q, scale = fp8_block_quantize(w) if s.init == "fp8" else mxfp4_quantize(w)
                data = _raw(q)
                pending_scale[s.name[: -len(".weight")] + ".scale"] = _raw(scale)
            else:
                data = _raw(_fill(s, seed, head_scale, vocab, experts))
            assert len(data) == s.nbytes, (s.name, len(data), s.nbytes)
            tensors.append((s.name, s.dtype, s.shape, data))
            weight_map[s.name] = name
            total += len(data)
            if progress is not None:
                progress(len(weight_map), len(specs), total)
        assert not pending_scale, pending_scale
        write_shard(os.path.join(out_dir, name), tensors)
    if tokenizer:
        from .tokenizer import write_tokenizer

        write_tokenizer(out_dir, vocab)
    # the index last and whole (renamed into place): `ensure` takes its presence for a finished checkpoint
    index = os.path.join(out_dir, "model.safetensors.index.json")
    with open(index + ".part", "w") as f:
        json.dump({"metadata": {"total_size": total, "dsv4_sm80_head_scale": head_scale, "dsv4_sm80_seed": seed},
                   "weight_map": weight_map}, f, indent=2)
    os.replace(index + ".part", index)
    summary = {"dir": out_dir, "tensors": len(specs), "shards": n_shards, "bytes": total,
               "seed": seed, "head_scale": head_scale, "vision": fmt.has_vision(config),
               "fast_experts": fast_experts}
    log(f"dsv4-sm80 make-tiny: {summary['tensors']} tensors, {n_shards} shards, "
        f"{total / 2**20:.1f} MiB -> {out_dir}")
    return summary


def _check_given(specs, weights) -> None:
    wanted = {s.name: given_shape(s) for s in specs if s.init != "pair"}
    missing = sorted(set(wanted) - set(weights))
    extra = sorted(set(weights) - set(wanted))
    wrong = sorted(k for k in set(wanted) & set(weights) if tuple(weights[k].shape) != tuple(wanted[k]))
    if missing or extra or wrong:
        raise TinyConfigError(
            f"given weights: {len(missing)} missing {missing[:3]}, {len(extra)} not in the format {extra[:3]}, "
            f"{len(wrong)} of another shape {[(k, tuple(weights[k].shape), wanted[k]) for k in wrong[:3]]}; "
            "expected exactly the inventory of the config (dsv4_sm80.checkpoint.format), unquantized shapes")


def _given(spec: fmt.TensorSpec, t: torch.Tensor) -> torch.Tensor:
    dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}[spec.dtype]
    return t.detach().cpu().to(dtype).contiguous()


def given_shape(spec: fmt.TensorSpec) -> tuple:
    """The shape `generate(weights=...)` takes for a spec: full precision, quantized weights unpacked."""
    return _dense_shape(spec) if spec.init in ("fp8", "mxfp4") else tuple(spec.shape)


def _dense_shape(spec: fmt.TensorSpec) -> tuple:
    """The unquantized [out, in] shape behind a quantized weight spec."""
    n_out, n_stored = spec.shape
    return (n_out, n_stored * 2) if spec.init == "mxfp4" else (n_out, n_stored)


def lab_checkpoint() -> str:
    """The embedded default model of lab mode (`serve` without --model-path under the gate's lab overrides): the
    tiny preset, generated once into the user's cache."""
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsv4_sm80", "tiny-s0-tok")
    if not os.path.isfile(os.path.join(cache, "model.safetensors.index.json")):
        generate(cache, tiny_config(PRESETS["tiny"]), seed=0, head_scale=12.0)
    return cache
