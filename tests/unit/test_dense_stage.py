"""Dense stage (dsv4_sm80/stages/dense.py): exact FP8-block -> BF16 conversion, and the SM80 linear
method inside real SGLang 0.5.16 linear layers on the CPU.

The reference is float64 arithmetic from the formats' definitions: e4m3 decoded from its bits
(tests/reference.py), the scale 2^(b-127), and round-to-nearest-even onto the BF16 grid (8
significant bits, subnormals down to 2^-133, overflow to inf) written there with frexp.
"""

import os

import numpy as np
import pytest
import torch

from conftest import REPO, last_json, run_python
from reference import dequant_fp8_bf16 as reference
from reference import e4m3_table, load_raw


def as_fp8(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn)


def as_e8m0(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e8m0fnu)


def test_every_e4m3_code_at_every_scale_byte():
    """All 254 non-NaN e4m3 codes times every finite E8M0 byte (0..254), exactly."""
    from dsv4_sm80.stages.dense import to_bf16_blocks

    codes = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)
    w = np.zeros((255 * 128, 256), dtype=np.uint8)
    w[:, : len(codes)] = codes  # block row i holds every code once per row
    scale = np.arange(255, dtype=np.uint8).reshape(255, 1).repeat(2, axis=1)
    got = to_bf16_blocks(as_fp8(w), as_e8m0(scale)).double().numpy()
    want = reference(w, scale)
    assert np.array_equal(got, want)
    assert np.isinf(got).any() and (got[np.nonzero(w)] == 0).any()  # the extremes really were exercised
    # the range real checkpoints hold (scales 2^-30..2^0) is lossless: no rounding at all
    mid = slice(97 * 128, 128 * 128)
    assert np.array_equal(got[mid], (e4m3_table()[w] * np.exp2(np.repeat(scale[:, :1], 128, 0) - 127.0))[mid])


def test_odd_shapes_and_float32_scales():
    from dsv4_sm80.stages.dense import to_bf16_blocks

    rng = np.random.default_rng(0)
    for n, k in ((200, 300), (1, 129), (257, 128), (128, 1000)):
        w = rng.integers(0, 256, (n, k), dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] = 0x11  # no NaN codes
        scale = rng.integers(100, 140, (-(-n // 128), -(-k // 128)), dtype=np.uint8)
        want = reference(w, scale)
        assert np.array_equal(to_bf16_blocks(as_fp8(w), as_e8m0(scale)).double().numpy(), want)
        s32 = torch.from_numpy(np.exp2(scale.astype(np.float64) - 127).astype(np.float32))
        assert np.array_equal(to_bf16_blocks(as_fp8(w), s32).double().numpy(), want)


def test_bad_inputs():
    from dsv4_sm80.stages.dense import to_bf16_blocks

    w = as_fp8(np.zeros((256, 256)))
    with pytest.raises(ValueError, match=r"scale shape \(1, 2\) does not match weight 256x256: expected \(2, 2\)"):
        to_bf16_blocks(w, torch.ones(1, 2))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        to_bf16_blocks(torch.zeros(256, 256, dtype=torch.bfloat16), torch.ones(2, 2))


def test_wo_a_wrapper_keeps_the_fp8_quant_config():
    from dsv4_sm80.stages.dense import build_wo_a_from_checkpoint

    class QC:
        weight_block_size = [128, 128]

    seen = build_wo_a_from_checkpoint(lambda self, *a, **k: (a, k), None, "cfg", 3, QC(), "p",
                                      compress_ratio=0, wo_a_fp8=False, wo_a_keeps_quant_config=False)
    assert seen[1] == {"compress_ratio": 0, "wo_a_fp8": False, "wo_a_keeps_quant_config": True}
    seen = build_wo_a_from_checkpoint(lambda self, *a, **k: (a, k), None, "cfg", 3, None, "p")
    assert seen[1] == {}  # an unquantized model is left alone


LAYERS = """
import json, os, sys
import numpy as np, torch
sys.path.insert(0, {tests!r})
from reference import load_raw
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:{port}", local_rank=0,
                             backend="gloo")
initialize_model_parallel(1)
from sglang.srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear,
                                     RowParallelLinear)
from sglang.srt.layers.quantization.fp8 import Fp8Config
qc = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
ckpt = {ckpt!r}
cfg = json.load(open(os.path.join(ckpt, "config.json")))
H, q, D, M = cfg["hidden_size"], cfg["q_lora_rank"], cfg["head_dim"], cfg["moe_intermediate_size"]
nh, G, o = cfg["num_attention_heads"], cfg["o_groups"], cfg["o_lora_rank"]
specs = {{  # checkpoint name -> (sglang class, in, out, prefix); "+"-joined names are fused shards
    "layers.2.attn.wq_b": (ColumnParallelLinear, q, nh * D, "model.layers.2.self_attn.wq_b"),
    "layers.2.attn.wo_a": (ColumnParallelLinear, nh * D // G, G * o, "model.layers.2.self_attn.wo_a"),
    "layers.2.attn.wo_b": (RowParallelLinear, G * o, H, "model.layers.2.self_attn.wo_b"),
    "layers.2.attn.indexer.wq_b": (ReplicatedLinear, q, 64 * 128, "model.layers.2.self_attn.indexer.wq_b"),
    "layers.3.ffn.shared_experts.w1+layers.3.ffn.shared_experts.w3":
        (MergedColumnParallelLinear, H, [M, M], "model.layers.3.mlp.shared_experts.gate_up_proj"),
    "layers.3.ffn.shared_experts.w2": (RowParallelLinear, M, H, "model.layers.3.mlp.shared_experts.down_proj"),
    "mtp.0.main_proj": (ReplicatedLinear, 3 * H, H, "model.stages.0.main_proj"),
}}
out, layers = {{}}, {{}}
for name, (cls, n_in, n_out, prefix) in specs.items():
    layer = layers[name] = cls(n_in, n_out, bias=False, quant_config=qc, prefix=prefix)
    method = layer.quant_method
    rec = {{"method": type(method).__name__, "use_marlin": bool(getattr(method, "use_marlin", False))}}
    shards = name.split("+")
    for shard_id, shard in enumerate(shards):
        for part in ("weight", "scale"):
            _, raw = load_raw(ckpt, f"{{shard}}.{{part}}")
            t = torch.from_numpy(raw.copy())
            t = t.view(torch.float8_e4m3fn) if part == "weight" else t.view(torch.float8_e8m0fnu)
            param = layer.weight if part == "weight" else layer.weight_scale_inv
            param.weight_loader(param, t, *([shard_id] if len(shards) > 1 else []))
    rec["loaded_dtype"] = str(layer.weight.dtype)
    if rec["method"] == "Sm80Bf16LinearMethod":
        method.process_weights_after_loading(layer)
        rec["after_dtype"] = str(layer.weight.dtype)
        rec["scale_left"] = hasattr(layer, "weight_scale_inv")
        np.save(os.path.join({outdir!r}, name + ".npy"), layer.weight.float().numpy())
        x = torch.randn(5, layer.input_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        y = method.apply(layer, x)
        rec["apply_matches"] = bool(torch.equal(y, torch.nn.functional.linear(x, layer.weight)))
    out[name] = rec
# a scale that never loaded is refused, naming the layer
layer = ReplicatedLinear(128, 128, bias=False, quant_config=qc, prefix="model.layers.9.self_attn.wq_a")
try:
    layer.quant_method.process_weights_after_loading(layer)
    out["unloaded"] = "accepted"
except Exception as e:
    out["unloaded"] = f"{{type(e).__name__}}: {{e}}"
from dsv4_sm80.stages import dense as linear
out["summary"] = linear.load_summary()
# the after-load state check over a model made of these layers, and its report line
holder = torch.nn.ModuleDict({{k.replace(".", "_").replace("+", "__"): v for k, v in layers.items()}})
try:
    linear.log_load_summary(None, holder, iter(()), torch.device("cpu"))
    out["state"] = [json.loads(l) for l in open(os.environ["DSV4_SM80_LOAD_REPORT"])]
except Exception as e:
    out["state"] = f"{{type(e).__name__}}: {{e}}"
print(json.dumps(out))
"""


def _run_layers(ckpt, outdir, dense, port):
    code = LAYERS.format(tests=os.path.join(REPO, "tests"), port=port, ckpt=ckpt, outdir=str(outdir))
    return last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", SGLANG_DSV4_A100_DENSE=dense,
                                DSV4_SM80_LOAD_REPORT=str(outdir / "report.jsonl")))


@pytest.mark.sglang
def test_bf16_mode_in_real_sglang_layers(unit_ckpt, tmp_path):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    out = _run_layers(unit_ckpt, tmp_path, "bf16", 29561)
    names = [n for n in out if n.count(".") > 1]
    assert len(names) == 7
    for name in names:
        rec = out[name]
        assert rec["method"] == "Sm80Bf16LinearMethod" and rec["loaded_dtype"] == "torch.float8_e4m3fn", (name, rec)
        assert rec["after_dtype"] == "torch.bfloat16" and not rec["scale_left"] and rec["apply_matches"], (name, rec)
        # fused shards (gate_up = w1 + w3) load through the block-scale-aware v2 loader: each its own rows
        want = np.concatenate([reference(load_raw(unit_ckpt, f"{shard}.weight")[1],
                                         load_raw(unit_ckpt, f"{shard}.scale")[1]) for shard in name.split("+")])
        assert np.array_equal(np.load(tmp_path / f"{name}.npy").astype(np.float64), want), name
    assert out["unloaded"].startswith("DenseLoadError: dsv4-sm80 dense: model.layers.9.self_attn.wq_a: "
                                      "weight_scale_inv was never loaded")
    assert out["summary"].startswith("dsv4-sm80 dense (bf16): 7 FP8 block linears converted to BF16")
    # the after-load check passes and reports every linear BF16, with its resident bytes
    (report,) = out["state"]
    assert report["model"] == "ModuleDict" and report["dense"] == "bf16" and report["rank"] == 0
    assert {r["name"]: (r["method"], r["dtype"]) for r in report["linears"]} == {
        n.replace(".", "_").replace("+", "__"): ("Sm80Bf16LinearMethod", "bfloat16") for n in names}
    assert sum(r["bytes"] for r in report["linears"]) == sum(
        np.load(tmp_path / f"{n}.npy").size * 2 for n in names)
    assert "FP8-checkpoint linears resident" in report["summary"]


@pytest.mark.sglang
def test_fp8_marlin_mode_keeps_fp8_except_wo_a_and_main_proj(unit_ckpt, tmp_path):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    out = _run_layers(unit_ckpt, tmp_path, "fp8_marlin", 29562)
    for name in ("layers.2.attn.wq_b", "layers.2.attn.wo_b", "layers.2.attn.indexer.wq_b",
                 "layers.3.ffn.shared_experts.w1+layers.3.ffn.shared_experts.w3", "layers.3.ffn.shared_experts.w2"):
        assert out[name] == {"method": "Fp8LinearMethod", "use_marlin": True,
                             "loaded_dtype": "torch.float8_e4m3fn"}, (name, out[name])
    for name in ("layers.2.attn.wo_a", "mtp.0.main_proj"):  # BF16 in both modes; main_proj never re-quantized
        assert out[name]["method"] == "Sm80Bf16LinearMethod" and out[name]["after_dtype"] == "torch.bfloat16"
    # the five above and the script's scale-less wq_a: counted when the method is selected
    assert "6 kept FP8 through SGLang's FP8-Marlin W8A16" in out["summary"]
    # Marlin repacks on the GPU only; an FP8 weight left as it loaded is refused by the after-load check
    assert out["state"].startswith("DenseLoadError: dsv4-sm80 dense.state: found 5 linear(s) on SGLang's "
                                   "native FP8 path after loading ModuleDict: layers_2_attn_wq_b "
                                   "(Fp8LinearMethod, float8_e4m3fn)"), out["state"]


@pytest.mark.sglang
def test_patch_off_leaves_sglangs_method():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    code = """
import json
from sglang.srt.layers.quantization.fp8 import Fp8Config
import sglang.srt.models.deepseek_v4 as m
print(json.dumps({"wrapped": hasattr(Fp8Config.get_quant_method, "__wrapped__"),
                  "dequant": m._dequant_fp8_wo_a.__module__}))
"""
    assert last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="0")) == {
        "wrapped": False, "dequant": "sglang.srt.models.deepseek_v4"}
    assert last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1")) == {
        "wrapped": True, "dequant": "dsv4_sm80.stages.dense"}


REDUCE = """
import json, torch
torch.cuda.get_device_capability = lambda device=None: (9, 0)  # an H200, as in a lab run
from sglang.srt.layers.quantization import marlin_utils, marlin_utils_fp8
cuda = torch.device("cuda")  # a device object only; nothing runs on it
args = (8, 512, 2048, cuda)  # wo_b at the tiny checkpoint's shape: n < 2048 <= k
print(json.dumps({"fp8_bf16": marlin_utils_fp8.should_use_atomic_add_reduce(*args, torch.bfloat16),
                  "fp8_fp16": marlin_utils_fp8.should_use_atomic_add_reduce(*args, torch.float16),
                  "upstream_bf16": marlin_utils.should_use_atomic_add_reduce(*args, torch.bfloat16)}))
"""


@pytest.mark.sglang
@pytest.mark.parametrize("patch,want_bf16", [("1", False), ("0", True)])
def test_fp8_marlin_reduces_in_fp32_as_on_sm80(patch, want_bf16):
    """FP8-Marlin's split-K reduction: upstream takes BF16 atomicAdd on capability >= 9 only; with the
    patch on, the name apply_fp8_marlin_linear calls answers as on an A800 (fp32 reduce for BF16), so
    a lab run of SGLANG_DSV4_A100_DENSE=fp8_marlin on an H200 runs the A800's datapath. Patch off:
    upstream's answer."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    out = last_json(run_python(REDUCE, ENABLE_SGLANG_DSV4_A100_PATCH=patch, SGLANG_DSV4_A100_DENSE="fp8_marlin"))
    assert out == {"fp8_bf16": want_bf16, "fp8_fp16": True, "upstream_bf16": True}, out
