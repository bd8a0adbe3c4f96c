"""The MoE stage (dsv4_sm80/stages/moe.py) inside real SGLang 0.5.16 on the CPU: a real FusedMoE layer built by
Fp8Config with the patch on, loaded from the unit checkpoint's MXFP4 experts through SGLang's own weight
loader, run through the W4A8 method (Triton interpreter), against the float64 reference computed from
the checkpoint bytes; the launch refusals; the Marlin SM80 lift."""

import os
from types import SimpleNamespace

import pytest

from conftest import REPO, last_json, run_python

pytestmark = pytest.mark.sglang

LAYER = """
import json, os, sys
import torch
sys.path.insert(0, {tests!r})
from reference import load_raw
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:{port}", local_rank=0,
                             backend="gloo")
initialize_model_parallel(1)
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
ckpt = {ckpt!r}
server_args = ServerArgs(model_path=ckpt, device="cpu", skip_tokenizer_init=True, moe_runner_backend="marlin")
set_global_server_args_for_scheduler(server_args)
from sglang.srt.layers.moe import initialize_moe_config
initialize_moe_config(server_args)  # marlin: what the launch makes of "auto" (the moe.runner_backend rule)
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
from sglang.srt.layers.moe.topk import StandardTopKOutput
from dsv4_sm80.kernels import w4a8_moe_ref as ref
from dsv4_sm80.stages import moe
cfg = json.load(open(os.path.join(ckpt, "config.json")))
H, M, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
qc = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128],
               is_fp4_experts=True)
layer = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=M, layer_id=3, top_k=3, quant_config=qc,
                 prefix="model.layers.3.mlp.experts", routed_scaling_factor=1.5, swiglu_limit=10.0)
out = {{"method": type(layer.quant_method).__name__}}
raw = {{}}
for e in range(E):
    for w, shard in (("w1", "w1"), ("w3", "w3"), ("w2", "w2")):
        for part in ("weight", "scale"):
            _, arr = load_raw(ckpt, f"layers.3.ffn.experts.{{e}}.{{w}}.{{part}}")
            t = torch.from_numpy(arr.copy()).view(torch.int8 if part == "weight" else torch.float8_e8m0fnu)
            raw[(e, w, part)] = t
            base = "w2" if shard == "w2" else "w13"
            pname = f"{{base}}_weight" if part == "weight" else f"{{base}}_weight_scale_inv"
            layer.weight_loader(getattr(layer, pname), t, f"experts.{{pname}}", shard_id=shard, expert_id=e)
before = {{n: p.numel() * p.element_size() for n, p in layer.named_parameters()}}
layer.quant_method.process_weights_after_loading(layer)
out["bytes_same"] = before == {{n: p.numel() * p.element_size() for n, p in layer.named_parameters()}}
g = torch.Generator().manual_seed(0)
T = 6
x = torch.randn(T, H, generator=g).to(torch.bfloat16)
ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(T)]).to(torch.int32)
tw = torch.rand(T, 3, generator=g)
tw = tw / tw.sum(1, keepdim=True)
topk = StandardTopKOutput(topk_weights=tw, topk_ids=ids, router_logits=torch.zeros(T, E))
y = layer.quant_method.apply(layer, StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                                           topk_output=topk)).hidden_states
w13 = torch.stack([torch.cat([raw[(e, "w1", "weight")], raw[(e, "w3", "weight")]]) for e in range(E)])
s13 = torch.stack([torch.cat([raw[(e, "w1", "scale")], raw[(e, "w3", "scale")]]) for e in range(E)])
w2 = torch.stack([raw[(e, "w2", "weight")] for e in range(E)])
s2 = torch.stack([raw[(e, "w2", "scale")] for e in range(E)])
exact = ref.moe_exact(x, w13, s13, w2, s2, tw, ids, scaling=1.5)
from dsv4_sm80.kernels.w4a8_moe_table import select
emu = ref.moe_int8_emulated(x, w13, s13, w2, s2, tw, ids, scaling=1.5, group=select(T * 3, M).kernel.group)
out["dtype"] = str(y.dtype)
out["rel_exact"] = float((y.double() - exact).norm() / exact.norm())
out["rel_emulated_max"] = float((y.double() - emu).abs().max() / emu.abs().max())
out["rel_double_scaled"] = float((y.double() - exact * 1.5).norm() / exact.norm())
f = moe.expert_footprint(torch.nn.ModuleDict({{"experts": layer}}))
state = moe.w4a8_layer(layer)
out["state"] = {{"expand_ok": state.expand_ok, "maps": [list(state.w13_eref.shape), list(state.w2_eref.shape)]}}
out["footprint"] = f
print(json.dumps(out))
"""


def test_w4a8_method_in_a_real_fused_moe_layer(unit_ckpt):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    code = LAYER.format(tests=os.path.join(REPO, "tests"), port=29571, ckpt=unit_ckpt)
    out = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", TRITON_INTERPRET="1",
                               SGLANG_DSV4_MXFP4_MOE_BACKEND="mxfp4_int8"))
    assert out["method"] == "Sm80W4A8MoEMethod" and out["bytes_same"], out
    # loaded through SGLang's own loader, repacked in place: the kernel sees exactly the checkpoint's
    # weights (equal to the INT8-activation emulation), the output is BF16, scaled by 1.5 once
    assert out["dtype"] == "torch.bfloat16"
    assert out["rel_emulated_max"] < 1e-2, out  # BF16 output rounding on top of the fp32 kernel result
    assert out["rel_exact"] < 2.5e-2 and out["rel_double_scaled"] > 0.4, out
    # the method's per-layer state (`layer.dsv4_w4a8`): the shift maps of both weights, read by the footprint line
    assert out["state"]["maps"][0][0] == out["state"]["maps"][1][0], out["state"]
    f = out["footprint"]
    assert f["layers"] == 1 and f["backends"] == ["mxfp4_int8"] and f["bytes"] == f["expected"], f
    assert f["repack_seconds"] > 0, f


def test_marlin_backend_keeps_sglangs_method_and_lifts_only_its_check():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    code = """
import json
import sglang.srt.layers.quantization.mxfp4_marlin_moe as m
import sglang.srt.utils.common as c
print(json.dumps({"lifted": getattr(m.is_sm90_supported, "_dsv4_sm80", False),
                  "elsewhere": getattr(c.is_sm90_supported, "_dsv4_sm80", False),
                  "cpu_answer": m.is_sm90_supported()}))
"""
    on = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", SGLANG_DSV4_MXFP4_MOE_BACKEND="marlin"))
    assert on == {"lifted": True, "elsewhere": False, "cpu_answer": False}  # no GPU here: still False
    off = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="0"))
    assert off["lifted"] is False


def _args(**kw):
    base = dict(ep_size=1, moe_a2a_backend="none", moe_runner_backend="auto")
    base.update(kw)
    return SimpleNamespace(**base)


def test_the_stages_rule_sets_marlin_and_refuses_expert_parallelism():
    """The MoE stage's rules on SGLang's arguments (seams.SERVER_ARGS), judged by the gate and set by the launch."""
    from dsv4_sm80.gate import checks as cc
    from dsv4_sm80.seams import SERVER_ARGS

    rules = {r.name: r for r in SERVER_ARGS if r.name.startswith("moe.")}
    assert set(rules) == {"moe.runner_backend", "moe.expert_parallel", "moe.a2a_backend"}
    args = _args()
    assert {n: cc.check_server_arg(r, args).status for n, r in rules.items()} == dict.fromkeys(rules, "pass")
    assert cc.server_arg_settings(args) == {"moe_runner_backend": "marlin", "kv_cache_dtype": "bfloat16"}
    assert cc.server_arg_settings(_args(moe_runner_backend="marlin")) == {"kv_cache_dtype": "bfloat16"}
    for bad, name, line in ((_args(ep_size=4), "moe.expert_parallel",
                             "FAIL moe.expert_parallel: found --ep-size 4"),
                            (_args(moe_a2a_backend="deepep"), "moe.a2a_backend", "found --moe-a2a-backend deepep"),
                            (_args(moe_runner_backend="triton"), "moe.runner_backend",
                             "FAIL moe.runner_backend: found --moe-runner-backend triton; expected auto or marlin")):
        f = cc.check_server_arg(rules[name], bad)
        assert f.status == "fail" and line in f.line() and f.fix.startswith("drop --"), f.line()


def test_engine_with_expert_parallelism_is_refused_before_any_scheduler(unit_ckpt):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    code = f"""
import sglang
try:
    sglang.Engine(model_path={unit_ckpt!r}, skip_tokenizer_init=True, tp_size=2, ep_size=2, device="cpu")
except BaseException as e:
    print(type(e).__name__, str(e).replace(chr(10), " | "))
"""
    res = run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", timeout=300)
    assert res.stdout.startswith("GateRefused") and "FAIL moe.expert_parallel: found --ep-size 2" in res.stdout, \
        res.stdout + res.stderr[-3000:]


ROUTING = """
import json
import torch
import torch.nn.functional as F
from sglang.srt.layers.moe.topk import biased_topk_impl
from sglang.srt.layers.moe.hash_topk import HashTopK
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(model_path={ckpt!r}, device="cpu", skip_tokenizer_init=True))
g = torch.Generator().manual_seed(0)
T, E, K, V = 9, 16, 6, 1000
logits = torch.randn(T, E, generator=g)
bias = torch.randn(E, generator=g) * 0.3
ids_tok = torch.randint(0, V, (T,), generator=g)
# the model's math (DeepSeek-V4 gate): scores = sqrt(softplus(logits)); choose top-k of scores + bias;
# weights are the unbiased scores of the chosen experts, normalized; hash layers take tid2eid[token]
scores = F.softplus(logits.double()).sqrt()
want_ids = (scores + bias.double()).topk(K, dim=1).indices
want_w = scores.gather(1, want_ids)
want_w = want_w / want_w.sum(1, keepdim=True)
w, ids = biased_topk_impl(logits, logits, bias, topk=K, renormalize=True, scoring_func="sqrtsoftplus")
order = ids.argsort(1)
ids_s, w_s = ids.gather(1, order).long(), w.gather(1, order)
worder = want_ids.argsort(1)
out = {{"biased_ids": torch.equal(ids_s, want_ids.gather(1, worder)),
        "biased_w": float((w_s.double() - want_w.gather(1, worder)).abs().max())}}
hk = HashTopK(topk=K, num_experts=E, num_fused_shared_experts=0, vocab_size=V, scoring_func="sqrtsoftplus",
              routed_scaling_factor=1.5)
tid2eid = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]).to(torch.int32)
hk.tid2eid.data.copy_(tid2eid)
hw, hids = hk._forward_torch(logits, ids_tok)
want_hids = tid2eid[ids_tok].long()
want_hw = scores.gather(1, want_hids)
want_hw = want_hw / want_hw.sum(1, keepdim=True)
out["hash_ids"] = torch.equal(hids.long(), want_hids)
out["hash_w"] = float((hw.double() - want_hw).abs().max())
print(json.dumps(out))
"""


def test_sglang_routing_is_the_models(unit_ckpt):
    """Routing stays SGLang's own DSV4 TopK (both SM80 backends consume its STANDARD output): its
    sqrtsoftplus + correction-bias choice and its hash-layer choice against the model's math."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    out = last_json(run_python(ROUTING.format(ckpt=unit_ckpt), TORCHDYNAMO_DISABLE="1"))
    assert out["biased_ids"] and out["hash_ids"], out
    assert out["biased_w"] < 1e-6 and out["hash_w"] < 1e-6, out
