"""The format rules (`dsv4_sm80.checkpoint.format`) against the published checkpoint totals.

The inventory code is the single description of the official checkpoint used by both the
generator and the gate, so it is checked here against numbers it was not derived from: the
published tensor counts and byte totals of the real releases (their model cards and safetensors indexes).
"""

import math
from collections import Counter

from dsv4_sm80.checkpoint import format as fmt


def _totals(cfg):
    inv = fmt.inventory(cfg)
    return inv, len(inv), sum(s.nbytes for s in inv)


def test_0731_matches_published_inventory():
    inv, n, nbytes = _totals(fmt.flash_0731_config())
    assert (n, nbytes) == (72_317, 166_878_536_440)
    per_shard = Counter(s.shard for s in inv)
    counts = [per_shard[i] for i in range(1, 49)]
    assert counts[:6] == [1, 1565, 1565, 1576, 1569, 1576]
    assert counts[-4:] == [5, 1568, 1565, 1572]
    # layers 2..42 alternate C4 (1576) and C128 (1569)
    assert counts[3:44] == [1576, 1569] * 20 + [1576]
    dtypes = Counter(s.dtype for s in inv)
    assert dtypes["F8_E4M3"] == 390 and dtypes["I8"] == 35_328


def test_original_release_matches_published_inventory():
    inv, n, nbytes = _totals(fmt.flash_original_config())
    assert (n, nbytes) == (69_187, 159_609_485_896)
    assert Counter(s.dtype for s in inv)["F8_E4M3"] == 375
    assert sum(1 for s in inv if s.name.startswith("mtp.0.")) == 1575


def test_vision_exp_adds_316_tensors():
    inv, n, _ = _totals(fmt.vision_exp_config())
    assert n == 72_633
    text = {s.name for s in fmt.inventory(fmt.flash_0731_config())}
    extra = [s.name for s in inv if s.name not in text]
    kinds = Counter(
        "vision" if x.startswith("vision.") else "aligner" if x.startswith("aligner.") else
        "image" if x.startswith("image_") else "bias_vl" if x.endswith("bias_vl") else "hash_bias" for x in extra)
    assert kinds == {"vision": 259, "aligner": 4, "image": 4, "bias_vl": 46, "hash_bias": 3}
    assert {s.dtype for s in inv if s.name.startswith(("vision.", "aligner.", "image_"))} == {"BF16"}


def test_shape_rules_on_real_widths():
    spec = {s.name: s for s in fmt.inventory(fmt.flash_0731_config())}
    assert spec["layers.0.attn.wq_b.weight"].shape == (32768, 1024)
    assert spec["layers.0.attn.wq_b.scale"].shape == (256, 8)
    assert spec["layers.0.attn.wo_a.weight"].shape == (8192, 4096)
    assert spec["layers.3.ffn.experts.255.w2.weight"] == fmt.TensorSpec(
        "layers.3.ffn.experts.255.w2.weight", "I8", (4096, 1024), fmt.EXPERT_WEIGHT, 5, "mxfp4")
    assert spec["layers.3.ffn.experts.255.w2.scale"].shape == (4096, 64)
    assert spec["layers.2.attn.indexer.wq_b.scale"].dtype == "F8_E8M0"
    assert spec["layers.0.ffn.gate.tid2eid"].dtype == "I64" and "layers.0.ffn.gate.bias" not in spec
    assert spec["layers.3.ffn.gate.bias"].dtype == "F32"
    assert spec["mtp.0.main_proj.weight"].shape == (4096, 12288)
    assert spec["mtp.2.confidence_head.proj.weight"].shape == (1, 4352)
    # every FP8 weight has its scale at ceil(out/128) x ceil(in/128)
    for w, s in fmt.fp8_pairs(spec.values()).items():
        o, i = spec[w].shape
        assert spec[s].shape == (math.ceil(o / 128), math.ceil(i / 128))


def test_fingerprints_hold_the_wheels_record_hashes():
    """The gate's 0.5.16 fingerprints include these files' RECORD hashes from the sglang-0.5.16 wheel verbatim."""
    from dsv4_sm80.upstream import FINGERPRINTS

    appendix_a = {
        "srt/models/deepseek_v4.py": "y_fzWMsXPKBwGVVKijdHT9VBbCDEk4cNmRdzSyk5mHA",
        "srt/models/deepseek_v4_nextn.py": "T2v5WgEb4P9KJ42OrAlS9XDW6z4tKSVxqTYn-P4gFuk",
        "srt/models/deepseek_v4_dspark.py": "2eA-lQ7Yt18Y446xeEPH_1fm0rsKM1y8uNpcBqAzV3k",
        "srt/models/deepseek_v2.py": "R3CZUbFdesSUwl8HmiQsFzdajuAQB8gp6gyatgR5Rok",
        "srt/layers/quantization/fp8.py": "JzH1iUiFMrpH2ZIdAajpYmQWJXHPzI6-L8VYVFRFZIU",
        "srt/layers/quantization/fp8_utils.py": "2jyYDketwSI2xVbXzlnfrBxr40cO8_qjS1zlg3YmsSI",
        "srt/layers/quantization/mxfp4_marlin_moe.py": "w9uHsqUAuVALQFbXaO4q5ORUzktr5Y00k5swfRjXL8s",
        "srt/layers/quantization/marlin_utils_fp4.py": "jKK4Yubb1zJgtog3PO_j7oprjV-jkj8APBMIn3QzWvE",
        "srt/layers/quantization/marlin_utils_fp8.py": "dYUVX6bEbV0_U3ZDNWL8fcWiyYErxT8BVKqf9gEefOw",
        "srt/layers/quantization/marlin_utils.py": "niKYb6ThgX6ljYSYZ44v09tPqpfeknIF-mCuWxGrrEk",
        "srt/layers/quantization/mxfp4_flashinfer_trtllm_moe.py": "6gJrhQkXqAWYxYFD8So3hdR2MjdlPZAzjB2Qqq5y1l4",
        "srt/layers/moe/moe_runner/marlin.py": "K74ScDcr7oU5k0O9ypY1OVukC_yvWEHmxKfx2Q49TSk",
        "srt/layers/moe/moe_runner/runner.py": "dJYMIQsOgThZHcJTZnExfpR2RydyDZ5V2ijk9tmKAi8",
        "srt/layers/moe/fused_moe_triton/fused_marlin_moe.py": "wMBnsnz1oz4Qa6T-YvTZpydAaftS-W5Uq6PfGzkHDCU",
        "srt/layers/moe/fused_moe_triton/layer.py": "GqmkVKNyZHamxS6LLCii4NGQfUYMEytMQc9IGtiliEw",
        "srt/arg_groups/deepseek_v4_hook.py": "HlP9nMIYa0sDeC5FxvnJlHYI-BVE25cm9Dayno9qeYY",
        "srt/arg_groups/overrides.py": "qJf0eHxdbGwBvnHe5CtTIty2zfHv65gfDU8u-gJqXp4",
        "srt/server_args.py": "4EVW3m2Zuop2uR__pJqnDqnWXNmfCdDaXUz-EijihQA",
        "srt/model_loader/loader.py": "t_Lhnk1vN9p35JAunYi6HzcpW1Q964-RWvN3ikmFvYc",
        "jit_kernel/csrc/gemm/marlin_moe/moe_wna16_marlin.cuh": "HeB0Mcafm5FKEMG7gibZ4WigwmyQjFzEIHt-PK5YomU",
    }
    assert {k: FINGERPRINTS.get(k) for k in appendix_a} == appendix_a
