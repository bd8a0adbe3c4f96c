"""The official DeepSeek-V4-Flash checkpoint format, as a function of its config.json.

`inventory(config)` lists every tensor the official checkpoint holds: native name, safetensors
dtype string, shape, the shard it lives in and its family. The tiny-checkpoint generator writes
exactly this list; the gate compares a checkpoint on disk against it. Rebuilt from the published
inventories (`tests/unit/test_checkpoint_format.py` checks this code against the published totals:
72,317 tensors / 166,878,536,440 bytes for -0731 and 69,187 / 159,609,485,896 for the original release).

Rules:
- FP8 block linear: `X.weight` F8_E4M3 [out, in] + `X.scale` F8_E8M0 [ceil(out/128), ceil(in/128)]
- MXFP4 routed expert: `X.weight` I8 [out, in/2] (two E2M1 codes per byte, low nibble = even
  column) + `X.scale` F8_E8M0 [out, in/32]
- F32: attn_sink, compressor ape, gate.bias, gate.bias_vl, hc_*; I64: gate.tid2eid; else BF16.
No torch import here.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from dataclasses import dataclass

# deepseek-ai/DeepSeek-V4-Flash-0731 @ 7872f01b config.json, in its key order.
FLASH_0731_CONFIG = OrderedDict([
    ("architectures", ["DeepseekV4ForCausalLM"]),
    ("attention_bias", False),
    ("attention_dropout", 0.0),
    ("bos_token_id", 0),
    ("eos_token_id", 1),
    ("expert_dtype", "fp4"),
    ("hc_eps", 1e-06),
    ("hc_mult", 4),
    ("hc_sinkhorn_iters", 20),
    ("head_dim", 512),
    ("hidden_act", "silu"),
    ("hidden_size", 4096),
    ("index_head_dim", 128),
    ("index_n_heads", 64),
    ("index_topk", 512),
    ("initializer_range", 0.02),
    ("max_position_embeddings", 1048576),
    ("model_type", "deepseek_v4"),
    ("moe_intermediate_size", 2048),
    ("n_routed_experts", 256),
    ("n_shared_experts", 1),
    ("norm_topk_prob", True),
    ("num_attention_heads", 64),
    ("num_experts_per_tok", 6),
    ("num_hidden_layers", 43),
    ("num_hash_layers", 3),
    ("num_key_value_heads", 1),
    ("num_nextn_predict_layers", 1),
    ("o_groups", 8),
    ("o_lora_rank", 1024),
    ("q_lora_rank", 1024),
    ("qk_rope_head_dim", 64),
    ("quantization_config", OrderedDict([
        ("activation_scheme", "dynamic"), ("fmt", "e4m3"), ("quant_method", "fp8"),
        ("scale_fmt", "ue8m0"), ("weight_block_size", [128, 128]),
    ])),
    ("rms_norm_eps", 1e-06),
    ("rope_scaling", OrderedDict([
        ("beta_fast", 32), ("beta_slow", 1), ("factor", 16),
        ("original_max_position_embeddings", 65536), ("type", "yarn"),
    ])),
    ("rope_theta", 10000),
    ("routed_scaling_factor", 1.5),
    ("scoring_func", "sqrtsoftplus"),
    ("sliding_window", 128),
    ("swiglu_limit", 10.0),
    ("tie_word_embeddings", False),
    ("topk_method", "noaux_tc"),
    ("torch_dtype", "bfloat16"),
    ("transformers_version", "4.57.1"),
    ("use_cache", True),
    ("vocab_size", 129280),
    ("compress_rope_theta", 160000),
    ("compress_ratios", [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]),
    ("dspark_block_size", 5),
    ("dspark_noise_token_id", 128799),
    ("dspark_target_layer_ids", [40, 41, 42]),
    ("dspark_markov_rank", 256),
])

# DeepSeek-V4-Flash-Vision-Exp: 0731 plus these.
VISION_EXP_FIELDS = OrderedDict([
    ("vision_n_layers", 32),
    ("vision_dim", 1024),
    ("vision_n_heads", 16),
    ("vision_inter_dim", 2816),
    ("vision_patch_size", 14),
    ("vision_rope_theta", 10000.0),
    ("vision_downsample_ratio", 3),
    ("vision_max_n_token", 384),
    ("vision_min_pixels", 147456),
    ("vision_max_wh_ratio", 8),
])


def flash_0731_config() -> OrderedDict:
    return copy.deepcopy(FLASH_0731_CONFIG)


def vision_exp_config() -> OrderedDict:
    cfg = flash_0731_config()
    cfg["num_nextn_predict_layers"] = 3
    cfg["rms_norm_eps"] = 1e-20
    cfg.update(copy.deepcopy(VISION_EXP_FIELDS))
    return cfg


def flash_original_config() -> OrderedDict:
    """The pre-0731 DeepSeek-V4-Flash release: one V3-style MTP block, no dspark_* keys."""
    cfg = flash_0731_config()
    for k in [k for k in cfg if k.startswith("dspark_")]:
        del cfg[k]
    cfg["compress_ratios"] = [0, 0] + [4, 128] * 20 + [4, 0]
    return cfg


# --- inventory --------------------------------------------------------------------------------

FP8_WEIGHT, FP8_SCALE = "fp8_weight", "fp8_scale"
EXPERT_WEIGHT, EXPERT_SCALE = "expert_weight", "expert_scale"
VISION = "vision"
PLAIN = "plain"

DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple
    family: str
    shard: int  # 1-based
    init: str = ""  # the tiny generator's fill rule; see dsv4_sm80.tiny.generate

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


class FormatError(ValueError):
    """The config lacks a field (or holds a value) the format rules need."""


def _cdiv(a, b):
    return -(-a // b)


def has_vision(config) -> bool:
    return int(config.get("vision_n_layers", 0) or 0) > 0


def is_dspark_layout(config) -> bool:
    return any(k.startswith("dspark_") for k in config)


def shard_count(config) -> int:
    return int(config["num_hidden_layers"]) + 2 + int(_num_mtp(config))


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _num_mtp(config) -> int:
    if is_dspark_layout(config):
        return len(config["dspark_target_layer_ids"])
    return int(config.get("num_nextn_predict_layers", 0))


def inventory(config) -> list[TensorSpec]:
    try:
        return _inventory(config)
    except KeyError as e:
        raise FormatError(f"config.json lacks {e.args[0]!r}") from None


def _inventory(c) -> list[TensorSpec]:
    H, L = int(c["hidden_size"]), int(c["num_hidden_layers"])
    nh, D = int(c["num_attention_heads"]), int(c["head_dim"])
    q, o, G = int(c["q_lora_rank"]), int(c["o_lora_rank"]), int(c["o_groups"])
    M, E = int(c["moe_intermediate_size"]), int(c["n_routed_experts"])
    ns, k = int(c.get("n_shared_experts", 1)), int(c["num_experts_per_tok"])
    V, hc = int(c["vocab_size"]), int(c["hc_mult"])
    n_idx, d_idx = int(c["index_n_heads"]), int(c["index_head_dim"])
    n_hash = int(c["num_hash_layers"])
    ratios = list(c["compress_ratios"])
    vision = has_vision(c)
    dspark = is_dspark_layout(c)
    n_mtp = _num_mtp(c)
    if len(ratios) < L:
        raise FormatError(f"compress_ratios has {len(ratios)} entries for {L} layers")
    if bad := sorted({r for r in ratios if r not in (0, 4, 128)}):
        raise FormatError(f"compress_ratios holds {bad}; only 0, 4, 128 exist")
    if H % 2 or M % 32 or H % 32:
        raise FormatError(f"hidden_size {H} and moe_intermediate_size {M} must be multiples of 32 (MXFP4)")
    if (nh * D) % G:
        raise FormatError(f"num_attention_heads*head_dim {nh * D} is not divisible by o_groups {G}")
    n_shards = L + 2 + n_mtp
    out: list[TensorSpec] = []

    def t(name, dtype, shape, shard, init, family=PLAIN):
        out.append(TensorSpec(name, dtype, tuple(int(x) for x in shape), family, shard, init))

    def fp8(name, n_out, n_in, shard):
        t(f"{name}.weight", "F8_E4M3", (n_out, n_in), shard, "fp8", FP8_WEIGHT)
        t(f"{name}.scale", "F8_E8M0", (_cdiv(n_out, 128), _cdiv(n_in, 128)), shard, "pair", FP8_SCALE)

    def expert(name, n_out, n_in, shard):
        t(f"{name}.weight", "I8", (n_out, n_in // 2), shard, "mxfp4", EXPERT_WEIGHT)
        t(f"{name}.scale", "F8_E8M0", (n_out, n_in // 32), shard, "pair", EXPERT_SCALE)

    def block(p, shard, ratio, hash_layer):
        """One decoder block (a layer, or a DSPARK / MTP stage)."""
        t(f"{p}.attn_norm.weight", "BF16", (H,), shard, "ones")
        t(f"{p}.ffn_norm.weight", "BF16", (H,), shard, "ones")
        t(f"{p}.attn.attn_sink", "F32", (nh,), shard, "zeros")
        t(f"{p}.attn.q_norm.weight", "BF16", (q,), shard, "ones")
        t(f"{p}.attn.kv_norm.weight", "BF16", (D,), shard, "ones")
        fp8(f"{p}.attn.wq_a", q, H, shard)
        fp8(f"{p}.attn.wq_b", nh * D, q, shard)
        fp8(f"{p}.attn.wkv", D, H, shard)
        fp8(f"{p}.attn.wo_a", G * o, nh * D // G, shard)
        fp8(f"{p}.attn.wo_b", H, G * o, shard)
        if ratio:
            coff = 2 if ratio == 4 else 1
            t(f"{p}.attn.compressor.ape", "F32", (ratio, coff * D), shard, "normal")
            t(f"{p}.attn.compressor.wkv.weight", "BF16", (coff * D, H), shard, "normal")
            t(f"{p}.attn.compressor.wgate.weight", "BF16", (coff * D, H), shard, "normal")
            t(f"{p}.attn.compressor.norm.weight", "BF16", (D,), shard, "ones")
        if ratio == 4:
            fp8(f"{p}.attn.indexer.wq_b", n_idx * d_idx, q, shard)
            t(f"{p}.attn.indexer.weights_proj.weight", "BF16", (n_idx, H), shard, "normal")
            t(f"{p}.attn.indexer.compressor.ape", "F32", (4, 2 * d_idx), shard, "normal")
            t(f"{p}.attn.indexer.compressor.wkv.weight", "BF16", (2 * d_idx, H), shard, "normal")
            t(f"{p}.attn.indexer.compressor.wgate.weight", "BF16", (2 * d_idx, H), shard, "normal")
            t(f"{p}.attn.indexer.compressor.norm.weight", "BF16", (d_idx,), shard, "ones")
        t(f"{p}.ffn.gate.weight", "BF16", (E, H), shard, "normal")
        if hash_layer:
            t(f"{p}.ffn.gate.tid2eid", "I64", (V, k), shard, "tid2eid")
            if vision:  # Vision-Exp ships the (unused) correction bias on hash layers too
                t(f"{p}.ffn.gate.bias", "F32", (E,), shard, "zeros", VISION)
        else:
            t(f"{p}.ffn.gate.bias", "F32", (E,), shard, "zeros")
        if vision:
            t(f"{p}.ffn.gate.bias_vl", "F32", (E,), shard, "bias_vl", VISION)
        fp8(f"{p}.ffn.shared_experts.w1", M * ns, H, shard)
        fp8(f"{p}.ffn.shared_experts.w2", H, M * ns, shard)
        fp8(f"{p}.ffn.shared_experts.w3", M * ns, H, shard)
        for e in range(E):
            expert(f"{p}.ffn.experts.{e}.w1", M, H, shard)
            expert(f"{p}.ffn.experts.{e}.w2", H, M, shard)
            expert(f"{p}.ffn.experts.{e}.w3", M, H, shard)
        for part in ("attn", "ffn"):
            t(f"{p}.hc_{part}_fn", "F32", ((2 + hc) * hc, hc * H), shard, "hc_fn")
            t(f"{p}.hc_{part}_base", "F32", ((2 + hc) * hc,), shard, "zeros")
            t(f"{p}.hc_{part}_scale", "F32", (3,), shard, "ones")

    def hc_head(p, shard):
        t(f"{p}hc_head_fn", "F32", (hc, hc * H), shard, "hc_fn")
        t(f"{p}hc_head_base", "F32", (hc,), shard, "zeros")
        t(f"{p}hc_head_scale", "F32", (1,), shard, "ones")

    t("embed.weight", "BF16", (V, H), 1, "normal")
    for i in range(L):
        block(f"layers.{i}", 2 + i, ratios[i], i < n_hash)
    head_shard = L + 2
    t("head.weight", "BF16", (V, H), head_shard, "head")
    t("norm.weight", "BF16", (H,), head_shard, "ones")
    hc_head("", head_shard)
    if vision:
        _vision_tensors(c, t, head_shard)

    for s in range(n_mtp):
        p, shard = f"mtp.{s}", head_shard + 1 + s
        if dspark:
            block(p, shard, 0, False)
            if s == 0:
                fp8(f"{p}.main_proj", H, H * n_mtp, shard)
                t(f"{p}.main_norm.weight", "BF16", (H,), shard, "ones")
            if s == n_mtp - 1:
                R = int(c["dspark_markov_rank"])
                t(f"{p}.norm.weight", "BF16", (H,), shard, "ones")
                hc_head(f"{p}.", shard)
                t(f"{p}.markov_head.markov_w1.weight", "BF16", (V, R), shard, "normal")
                t(f"{p}.markov_head.markov_w2.weight", "BF16", (V, R), shard, "normal")
                t(f"{p}.confidence_head.proj.weight", "BF16", (1, H + R), shard, "normal")
        else:  # original release: V3-style MTP block
            block(p, shard, 0, False)
            fp8(f"{p}.e_proj", H, H, shard)
            fp8(f"{p}.h_proj", H, H, shard)
            for n in ("enorm", "hnorm", "norm"):
                t(f"{p}.{n}.weight", "BF16", (H,), shard, "ones")
            hc_head(f"{p}.", shard)
    assert max(x.shard for x in out) == n_shards
    return out


def _vision_tensors(c, t, shard):
    """Vision-Exp: ViT, aligner and image-block vectors, all BF16."""
    Vd, Vi = int(c["vision_dim"]), int(c["vision_inter_dim"])
    P, r, H = int(c["vision_patch_size"]), int(c["vision_downsample_ratio"]), int(c["hidden_size"])

    def v(name, shape, init="normal"):
        t(name, "BF16", shape, shard, init, VISION)

    v("vision.patch_embed.proj.weight", (Vd, 3 * P * P))
    v("vision.patch_embed.proj.bias", (Vd,), "zeros")
    for b in range(int(c["vision_n_layers"])):
        p = f"vision.blocks.{b}"
        v(f"{p}.norm1.weight", (Vd,), "ones")
        v(f"{p}.norm2.weight", (Vd,), "ones")
        v(f"{p}.attn.wqkv.weight", (3 * Vd, Vd))
        v(f"{p}.attn.wqkv.bias", (3 * Vd,), "zeros")
        v(f"{p}.attn.wo.weight", (Vd, Vd))
        v(f"{p}.attn.wo.bias", (Vd,), "zeros")
        v(f"{p}.mlp.w1.weight", (2 * Vi, Vd))
        v(f"{p}.mlp.w2.weight", (Vd, Vi))
    v("vision.norm.weight", (Vd,), "ones")
    v("aligner.w1.weight", (H, Vd * r * r))
    v("aligner.w1.bias", (H,), "zeros")
    v("aligner.w2.weight", (H, H))
    v("aligner.w2.bias", (H,), "zeros")
    for n in ("image_start", "image_pad", "image_newline", "image_end"):
        v(n, (H,))


def fp8_pairs(specs) -> dict[str, str]:
    """{weight name: scale name} for every FP8 block linear."""
    return {s.name: s.name[: -len(".weight")] + ".scale" for s in specs if s.family == FP8_WEIGHT}
