"""The tiny-checkpoint generator against the format rules, and SGLang 0.5.16 reading its output.

The decoders here are written from the formats' bit layouts (float64), not taken from the
generator: e4m3 (1-4-3, bias 7, subnormals), E8M0 (2^(b-127)), E2M1 (1-2-1, bias 1).
"""

import json
import math
import os
from collections import OrderedDict

import numpy as np
import pytest

from dsv4_sm80.checkpoint import format as fmt
from dsv4_sm80.checkpoint.safetensors_io import read_header
from reference import dequant_fp8, dequant_mxfp4, e2m1_table, e8m0, load_raw


def test_config_is_0731_with_widths_changed(unit_ckpt):
    cfg = json.load(open(os.path.join(unit_ckpt, "config.json")), object_pairs_hook=OrderedDict)
    real = fmt.flash_0731_config()
    assert list(cfg) == list(real)  # same keys, same order
    changed = {k for k in real if cfg[k] != real[k]}
    assert changed <= {"hidden_size", "num_hidden_layers", "num_attention_heads", "o_groups", "q_lora_rank",
                       "o_lora_rank", "moe_intermediate_size", "n_routed_experts", "vocab_size",
                       "compress_ratios", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_noise_token_id"}
    assert cfg["compress_ratios"] == [0, 0, 4, 128, 4, 0, 0, 0]
    assert cfg["dspark_target_layer_ids"] == [2, 3, 4]
    assert cfg["num_attention_heads"] == 64
    for absent in ("n_group", "topk_group", "first_k_dense_replace", "n_hash_layers"):
        assert absent not in cfg  # their absence is a parsing path in SGLang


def test_vision_config_fields(unit_vision_ckpt):
    cfg = json.load(open(os.path.join(unit_vision_ckpt, "config.json")), object_pairs_hook=OrderedDict)
    assert list(cfg)[-10:] == list(fmt.VISION_EXP_FIELDS)
    assert cfg["num_nextn_predict_layers"] == 3 and cfg["rms_norm_eps"] == 1e-20
    assert cfg["vision_patch_size"] == 14 and cfg["vision_downsample_ratio"] == 3
    assert cfg["vision_dim"] // cfg["vision_n_heads"] == 64


def test_shards_index_and_dtypes(unit_ckpt):
    cfg = json.load(open(os.path.join(unit_ckpt, "config.json")))
    H, M = cfg["hidden_size"], cfg["moe_intermediate_size"]
    index = json.load(open(os.path.join(unit_ckpt, "model.safetensors.index.json")))
    shards = sorted(f for f in os.listdir(unit_ckpt) if f.endswith(".safetensors"))
    n = cfg["num_hidden_layers"] + 5
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    total, seen = 0, {}
    for f in shards:
        h = read_header(os.path.join(unit_ckpt, f))
        assert h.metadata == {"format": "pt"} and h.header_len % 8 == 0
        assert h.file_size == h.expected_file_size
        for name, t in h.tensors.items():
            seen[name] = (t["dtype"], tuple(t["shape"]), f)
            total += t["data_offsets"][1] - t["data_offsets"][0]
    assert index["metadata"]["total_size"] == total
    assert {k: v[2] for k, v in seen.items()} == index["weight_map"]
    assert seen["embed.weight"][2] == shards[0] and seen["head.weight"][2] == shards[n - 4]
    assert all(v[2] == shards[n - 3] for k, v in seen.items() if k.startswith("mtp.0."))
    assert "mtp.0.main_proj.weight" in seen and "mtp.2.markov_head.markov_w1.weight" in seen
    for name, (dtype, shape, _) in seen.items():
        if name.endswith(".scale"):
            w_dtype, w_shape, _ = seen[name[: -len("scale")] + "weight"]
            assert dtype == "F8_E8M0"
            if w_dtype == "F8_E4M3":
                assert shape == (math.ceil(w_shape[0] / 128), math.ceil(w_shape[1] / 128)), name
            else:
                assert w_dtype == "I8" and ".experts." in name and shape == (w_shape[0], w_shape[1] * 2 // 32), name
        elif ".experts." in name:
            part = name.rsplit(".", 2)[-2]
            assert (dtype, shape) == ("I8", (M, H // 2) if part in ("w1", "w3") else (H, M // 2)), name
        elif (name.endswith(("attn_sink", ".ape", "gate.bias")) or ".hc_" in name or name.startswith("hc_")
              or ".hc_head" in name):
            assert dtype == "F32", name
        elif name.endswith("tid2eid"):
            assert dtype == "I64" and shape == (cfg["vocab_size"], cfg["num_experts_per_tok"])
        else:
            assert dtype in ("BF16", "F8_E4M3"), name
    hash_layers = {k.split(".")[1] for k in seen if k.endswith("tid2eid")}
    assert hash_layers == {"0", "1", "2"}
    # the C4 layer carries an indexer, the C128 layer a compressor only, SWA layers neither
    assert "layers.2.attn.indexer.wq_b.weight" in seen and "layers.3.attn.indexer.wq_b.weight" not in seen
    assert seen["layers.3.attn.compressor.ape"][1] == (128, 512)
    assert seen["layers.2.attn.compressor.ape"][1] == (4, 1024)
    assert not any(k.startswith("layers.0.attn.compressor") for k in seen)


def test_header_follows_inventory_order(unit_ckpt):
    cfg = json.load(open(os.path.join(unit_ckpt, "config.json")))
    spec_order = [s.name for s in fmt.inventory(cfg) if s.shard == 2]
    h = read_header(os.path.join(unit_ckpt, "model-00002-of-00010.safetensors"))
    assert list(h.tensors) == spec_order


# --- values -------------------------------------------------------------------------------------


def test_fp8_blocks_decode_to_the_draw(unit_ckpt):
    import torch

    from dsv4_sm80.tiny.generate import WEIGHT_STD, _rng

    for name in ("layers.2.attn.wq_b", "layers.0.attn.wo_a", "mtp.0.main_proj", "layers.2.ffn.shared_experts.w2"):
        _, wq = load_raw(unit_ckpt, name + ".weight")
        _, sb = load_raw(unit_ckpt, name + ".scale")
        deq = dequant_fp8(wq, sb)
        ref = (torch.randn(wq.shape, generator=_rng(0, name + ".weight")) * WEIGHT_STD).double().numpy()
        assert np.all(np.isfinite(deq))
        s = np.repeat(np.repeat(e8m0(sb), 128, 0), 128, 1)[: wq.shape[0], : wq.shape[1]]
        # 3 mantissa bits: rounding error <= 2^-4 relative, or half a subnormal step (2^-10 * s)
        assert np.all(np.abs(deq - ref) <= np.maximum(np.abs(ref) * 2.0 ** -4, s * 2.0 ** -10) + 1e-12), name
        # the scale is the smallest power of two that fits the block's amax into 448
        bo, bi = sb.shape
        for i in range(bo):
            for j in range(bi):
                amax = np.abs(ref[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max()
                scale = e8m0(sb[i, j])
                assert 224 < amax / scale <= 448


def test_mxfp4_experts_decode_to_the_draw(unit_ckpt):
    import torch

    from dsv4_sm80.tiny.generate import WEIGHT_STD, _rng

    for name in ("layers.0.ffn.experts.0.w1", "layers.4.ffn.experts.7.w2", "mtp.1.ffn.experts.3.w3"):
        _, packed = load_raw(unit_ckpt, name + ".weight")
        _, sb = load_raw(unit_ckpt, name + ".scale")
        deq = dequant_mxfp4(packed, sb)
        ref = (torch.randn(deq.shape, generator=_rng(0, name + ".weight")) * WEIGHT_STD).double().numpy()
        s = np.repeat(e8m0(sb), 32, axis=1)
        groups = np.abs(ref).reshape(ref.shape[0], -1, 32).max(axis=2) / e8m0(sb)
        assert np.all((groups > 3) & (groups <= 6)), name  # smallest power of two with amax/s <= 6
        # nearest E2M1 value: the error is at most half the widest gap (4 -> 6) times the scale
        values = np.unique(np.abs(e2m1_table()))
        nearest = values[np.abs(np.abs(ref / s)[..., None] - values).argmin(-1)] * np.sign(ref) * s
        assert np.allclose(deq, nearest, atol=1e-12), name


def test_mxfp4_nibble_order_and_sglang_table():
    import torch

    from dsv4_sm80.tiny.quant import mxfp4_quantize

    row = torch.tensor([[0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5] + [0.0] * 23 + [-6.0]])
    packed, scale = mxfp4_quantize(row)
    assert scale.tolist() == [[127]]  # amax 6 -> scale 1.0
    codes = [packed[0, j // 2].item() >> (4 * (j % 2)) & 0xF for j in range(32)]
    assert packed[0, 0].item() == 0x21  # even column (0.5 -> code 1) in the low nibble, 1.0 -> 2 high
    assert [e2m1_table()[c] for c in codes] == row[0].tolist()
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from sglang.srt.layers.quantization.fp8 import DSV4_DEQUANT_FP4_TABLE

    assert DSV4_DEQUANT_FP4_TABLE.double().tolist() == e2m1_table().tolist()


def test_other_values(unit_ckpt):
    cfg = json.load(open(os.path.join(unit_ckpt, "config.json")))
    _, tid = load_raw(unit_ckpt, "layers.1.ffn.gate.tid2eid")
    assert tid.shape == (cfg["vocab_size"], 6)
    assert all(len(set(r)) == 6 for r in tid.tolist()) and tid.min() >= 0 and tid.max() < cfg["n_routed_experts"]
    assert np.all(load_raw(unit_ckpt, "layers.0.attn_norm.weight")[1] == 1.0)
    assert np.all(load_raw(unit_ckpt, "layers.0.attn.attn_sink")[1] == 0.0)
    for name in ("embed.weight", "head.weight", "layers.2.hc_attn_fn", "layers.3.attn.compressor.ape"):
        vals = load_raw(unit_ckpt, name)[1]
        assert np.all(np.isfinite(vals)) and 0 < vals.std() < 1, name


def test_seed_and_head_scale(tmp_path, unit_ckpt):
    import hashlib

    from dsv4_sm80.tiny.generate import PRESETS, generate, tiny_config

    def digest(d, f="model-00002-of-00010.safetensors"):
        return hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()

    generate(str(tmp_path / "a"), tiny_config(PRESETS["unit"]), seed=0, head_scale=12.0, log=lambda *_: None)
    generate(str(tmp_path / "b"), tiny_config(PRESETS["unit"]), seed=1, log=lambda *_: None)
    assert digest(tmp_path / "a") == digest(unit_ckpt)  # reproducible
    assert digest(tmp_path / "b") != digest(unit_ckpt)
    head0 = load_raw(unit_ckpt, "head.weight")[1]
    head12 = load_raw(str(tmp_path / "a"), "head.weight")[1]
    assert abs(head12.std() / head0.std() - 12.0) < 0.1


def test_tiny_size_rules():
    from dsv4_sm80.tiny.generate import TinyConfigError, TinySize, tiny_config

    for bad in (TinySize(hidden=500), TinySize(layers=3), TinySize(o_groups=3), TinySize(experts=4)):
        with pytest.raises(TinyConfigError):
            tiny_config(bad)
    with pytest.raises(TinyConfigError, match="placeholder"):
        tiny_config(TinySize(vocab=4096), vision=True)


def test_vision_tensors(unit_vision_ckpt):
    cfg = json.load(open(os.path.join(unit_vision_ckpt, "config.json")))
    h = {}
    for f in os.listdir(unit_vision_ckpt):
        if f.endswith(".safetensors"):
            h.update(read_header(os.path.join(unit_vision_ckpt, f)).tensors)
    Vd, P, r, H = cfg["vision_dim"], cfg["vision_patch_size"], cfg["vision_downsample_ratio"], cfg["hidden_size"]
    assert h["vision.patch_embed.proj.weight"]["shape"] == [Vd, 3 * P * P]
    assert h["aligner.w1.weight"]["shape"] == [H, Vd * r * r]
    assert h["vision.blocks.1.mlp.w1.weight"]["shape"] == [2 * cfg["vision_inter_dim"], Vd]
    assert {h[k]["dtype"] for k in h if k.startswith(("vision.", "aligner.", "image_"))} == {"BF16"}
    assert sum(k.endswith("bias_vl") for k in h) == cfg["num_hidden_layers"] + 3
    assert all(f"layers.{i}.ffn.gate.bias" in h for i in range(3))  # hash layers carry it in Vision-Exp


# --- SGLang 0.5.16 reads it ------------------------------------------------------------------------

sglang_required = pytest.mark.sglang


@sglang_required
def test_sglang_probes_and_iterator(unit_ckpt):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    import glob

    import torch
    from sglang.srt.configs.deepseek_v4 import try_detect_fp4_experts
    from sglang.srt.model_loader.weight_utils import (
        probe_routed_expert_weight_dtype,
        safetensors_weights_iterator,
    )

    assert probe_routed_expert_weight_dtype(unit_ckpt) == "I8"
    assert try_detect_fp4_experts(unit_ckpt) is True
    want = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
            "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}
    headers = {}
    for f in glob.glob(os.path.join(unit_ckpt, "*.safetensors")):
        headers.update(read_header(f).tensors)
    n = 0
    for name, t in safetensors_weights_iterator(sorted(glob.glob(os.path.join(unit_ckpt, "*.safetensors")))):
        assert t.dtype == want[headers[name]["dtype"]] and list(t.shape) == headers[name]["shape"], name
        n += 1
    assert n == len(headers)
    # the loader sees the same block scale the reference decoder does
    wq = dict(safetensors_weights_iterator([os.path.join(unit_ckpt, "model-00004-of-00010.safetensors")]))
    s = wq["layers.2.attn.wq_b.scale"].float().double().numpy()
    assert np.array_equal(s, e8m0(load_raw(unit_ckpt, "layers.2.attn.wq_b.scale")[1]))


@sglang_required
def test_sglang_config_and_name_remapping(unit_ckpt):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    mc = ModelConfig(unit_ckpt)
    hf = mc.hf_config
    assert hf.architectures == ["DeepseekV4ForCausalLM"] and mc.quantization == "fp8"
    assert hf.num_hash_layers == 3 and hf.compress_ratios == [0, 0, 4, 128, 4, 0, 0, 0]
    assert hf.index_topk == 512 and hf.sliding_window == 128 and hf.head_dim == 512
    assert mc.is_fp4_experts is True

    names = list(json.load(open(os.path.join(unit_ckpt, "model.safetensors.index.json")))["weight_map"])
    remap = DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format
    mapped = {n: remap(n) for n in names if not n.startswith("mtp.")}
    assert mapped["embed.weight"] == "model.embed_tokens.weight" and mapped["head.weight"] == "lm_head.weight"
    assert mapped["layers.2.attn.wq_b.scale"] == "model.layers.2.self_attn.wq_b.weight_scale_inv"
    assert mapped["layers.0.ffn.gate.tid2eid"] == "model.layers.0.mlp.topk.tid2eid"
    assert mapped["layers.3.ffn.gate.bias"] == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert mapped["layers.1.ffn.experts.5.w2.scale"] == "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"
    assert mapped["layers.4.ffn_norm.weight"] == "model.layers.4.post_attention_layernorm.weight"
    for src, dst in mapped.items():
        assert dst.startswith(("model.", "lm_head.")), dst
        assert ".attn." not in dst and ".ffn." not in dst and not dst.endswith(".scale"), (src, dst)
        assert not any(f".w{i}." in dst for i in (1, 2, 3)), (src, dst)


def test_wide_preset_and_fast_experts(tmp_path, unit_ckpt):
    """The full-width preset is a valid DSV4-Flash geometry (per-rank shapes of the real model); fast
    experts change only the routed-expert bytes (random codes, E8M0 2^-8..2^-6) and the checkpoint still
    passes the gate's format checks."""
    import compat_check as cc
    from dsv4_sm80.tiny.generate import PRESETS, generate, tiny_config

    cfg = tiny_config(PRESETS["wide"])
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["o_lora_rank"],
            cfg["moe_intermediate_size"], cfg["n_routed_experts"]) == (4096, 64, 1024, 1024, 2048, 256)
    out = tmp_path / "fast"
    generate(str(out), tiny_config(PRESETS["unit"]), seed=0, log=lambda *_: None, fast_experts=True)
    findings = cc.check_model_files(cc.collect_model(str(out)))
    assert not cc.failures(findings), [f.line() for f in cc.failures(findings)]
    expert = "layers.0.ffn.experts.3.w1"
    _, fast_w = load_raw(str(out), expert + ".weight")
    _, fast_s = load_raw(str(out), expert + ".scale")
    _, slow_w = load_raw(unit_ckpt, expert + ".weight")
    assert fast_w.shape == slow_w.shape and not np.array_equal(fast_w, slow_w)
    assert set(np.unique(fast_s.view(np.uint8))) <= {119, 120, 121}
    for name in ("layers.0.attn.wq_b.weight", "embed.weight"):  # everything else as before
        assert np.array_equal(load_raw(str(out), name)[1], load_raw(unit_ckpt, name)[1]), name


def test_stand_in_tokenizer(unit_ckpt, tmp_path):
    """Every tiny checkpoint ships a tokenizer SGLang's HTTP path can use: exactly vocab_size ids (any id a
    random model emits decodes), BOS/EOS at config.json's ids, SGLang's DSV4 chat encoding round-trips."""
    transformers = pytest.importorskip("transformers")
    cfg = json.load(open(os.path.join(unit_ckpt, "config.json")))
    tok = transformers.AutoTokenizer.from_pretrained(unit_ckpt)
    assert len(tok) == cfg["vocab_size"] == 1024
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    text = "<｜begin▁of▁sentence｜><｜User｜>Hello, 世界! <think>x</think><｜Assistant｜>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [0, 2] and tok.decode(ids) == text
    assert len(tok.decode(list(range(1024)))) > 0
    from dsv4_sm80.tiny.tokenizer import write_tokenizer

    write_tokenizer(str(tmp_path), 129280)  # the real vocabulary: the vision sentinels at 129257..129261
    big = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(big) == 129280 and big.convert_ids_to_tokens(129257) == "<|place_holder_mm_span_0431|>"


def test_ensure_generates_once(tmp_path):
    """The GPU scripts' first use: a checkpoint is generated only where none is."""
    from dsv4_sm80.tiny.generate import ensure

    out = str(tmp_path / "u")
    assert ensure(out, "unit", log=lambda *_: None) == out
    index = os.path.join(out, "model.safetensors.index.json")
    stamp = os.path.getmtime(index)
    ensure(out, "unit", log=lambda *_: None)
    assert os.path.getmtime(index) == stamp


def test_ensure_generates_once_under_concurrent_callers(tmp_path, monkeypatch):
    """The GPU lanes start at once and all ensure the same checkpoint: one writes it, the others wait for it
    (they would otherwise rewrite shards another process is reading)."""
    import threading
    import time

    from dsv4_sm80.tiny import generate as gen

    calls = []
    real = gen.generate

    def slow_generate(out_dir, config, **kw):
        calls.append(out_dir)
        time.sleep(0.3)
        return real(out_dir, config, **kw)

    monkeypatch.setattr(gen, "generate", slow_generate)
    out = str(tmp_path / "c")
    seen = []
    workers = [threading.Thread(target=lambda: seen.append(
        os.path.isfile(os.path.join(gen.ensure(out, "unit", log=lambda *_: None), "model.safetensors.index.json"))))
        for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert calls == [out] and seen == [True, True, True]


def test_head_scale_is_recorded_and_a_different_one_refused(tmp_path):
    from dsv4_sm80.tiny import generate as gen

    out = str(tmp_path / "ck")
    gen.ensure(out, "unit", log=lambda *_: None, head_scale=3.0)
    assert gen.head_scale_of(out) == 3.0
    assert gen.ensure(out, "unit", log=lambda *_: None, head_scale=3.0) == out
    assert gen.ensure(out, "unit", log=lambda *_: None) == out  # nothing asked: whatever it holds
    with pytest.raises(gen.TinyConfigError, match=r"generated with head_scale 3.0, this run asks for 12.0"):
        gen.ensure(out, "unit", log=lambda *_: None, head_scale=12.0)


def test_peaked_head_scale_gives_every_preset_the_tiny_beds_logit_spread():
    from dsv4_sm80.tiny.generate import PEAKED_HEAD_SCALE, PRESETS, WEIGHT_STD

    spread = {p: PRESETS[p].hidden ** 0.5 * WEIGHT_STD * PEAKED_HEAD_SCALE[p] for p in ("tiny", "wide")}
    assert abs(spread["wide"] - spread["tiny"]) < 1e-3 * spread["tiny"], spread
