"""GPU check of the MoE stage on the whole tiny model: SGLang 0.5.16's own ModelRunner loads the
checkpoint in this process (TP1, the patch state and backend from the environment); then every routed-
expert layer runs on the same seeded inputs (hidden states and a fixed top-k routing) through whatever
method SGLang built for it, and is compared with the float64 reference computed from the checkpoint's
bytes (dsv4_sm80/kernels/w4a8_moe_ref.py) and, with --compare, with another run's outputs.

    ENABLE_SGLANG_DSV4_A100_PATCH=0 python -m dsv4_lab.beds.moe_check --out $OUT/moe-native.pt
    ENABLE_SGLANG_DSV4_A100_PATCH=1 SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin \
        python -m dsv4_lab.beds.moe_check --out $OUT/moe-marlin.pt --compare $OUT/moe-native.pt
    ENABLE_SGLANG_DSV4_A100_PATCH=1 SGLANG_DSV4_MXFP4_MOE_BACKEND=mxfp4_int8 \
        python -m dsv4_lab.beds.moe_check --out $OUT/moe-int8.pt --compare $OUT/moe-native.pt

Outputs are compared after the routed scaling factor: SGLang's MXFP4 Marlin method leaves it to DeepseekV2MoE
(`maybe_fuse_routed_scale_and_shared_add`), the W4A8 method applies it itself, so the Marlin outputs are scaled here
once for the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare")
    ap.add_argument("--ckpt", default="/tmp/dsv4-tiny")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--head-scale", type=float, default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    args = ap.parse_args(argv)

    import faulthandler

    faulthandler.dump_traceback_later(500, exit=False)
    import torch

    from dsv4_lab.beds.dense_check import build_runner, reference
    from dsv4_sm80 import env
    from dsv4_sm80.kernels import w4a8_moe_ref as ref
    from dsv4_sm80.stages import moe
    from dsv4_sm80.tiny.generate import ensure, head_scale_for

    load_raw = reference().load_raw

    args.head_scale = head_scale_for(args.preset, args.head_scale)  # peaked outputs at every width
    ensure(args.ckpt, args.preset, head_scale=args.head_scale)
    cfg = json.load(open(os.path.join(args.ckpt, "config.json")))
    top_k, scaling = int(cfg["num_experts_per_tok"]), float(cfg["routed_scaling_factor"])
    limit = float(cfg.get("swiglu_limit") or 0.0)

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.quantization.mxfp4_marlin_moe import Mxfp4MarlinMoEMethod

    t0 = time.time()
    runner = build_runner(args.ckpt, args.mem_fraction)
    load_s = time.time() - t0
    layers = [(name, mod) for name, mod in runner.model.named_modules() if isinstance(mod, FusedMoE)]
    record = {"patch": env.patch_enabled(), "backend": env.get(env.MOE_BACKEND) if env.patch_enabled() else "native",
              "gpu": torch.cuda.get_device_name(0), "load_s": round(load_s, 1),
              "footprint": moe.expert_footprint(runner.model), "layers": []}
    outputs = {}
    for i, (name, mod) in enumerate(layers):
        e, h = mod.w13_weight.shape[0], mod.hidden_size
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        x = torch.randn(args.tokens, h, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, generator=g, device="cuda")[:top_k] for _ in range(args.tokens)])
        ids = ids.to(torch.int32)
        tw = torch.rand(args.tokens, top_k, generator=g, device="cuda")
        tw = tw / tw.sum(1, keepdim=True)
        topk = StandardTopKOutput(topk_weights=tw, topk_ids=ids, router_logits=torch.zeros(args.tokens, e,
                                                                                           device="cuda"))
        torch.cuda.synchronize()
        t1 = time.time()
        y = mod.quant_method.apply(mod, StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                                               topk_output=topk)).hidden_states
        torch.cuda.synchronize()
        first_call_s = time.time() - t1
        y = y.float() * (scaling if isinstance(mod.quant_method, Mxfp4MarlinMoEMethod) else 1.0)
        layer_idx = int(name.split(".")[2])
        parts = {}
        for w in ("w1", "w2", "w3"):
            for part in ("weight", "scale"):
                parts[(w, part)] = torch.stack([
                    torch.from_numpy(load_raw(args.ckpt, f"layers.{layer_idx}.ffn.experts.{j}.{w}.{part}")[1].copy())
                    for j in range(e)])
        w13 = torch.cat([parts[("w1", "weight")], parts[("w3", "weight")]], dim=1)
        s13 = torch.cat([parts[("w1", "scale")], parts[("w3", "scale")]], dim=1)
        exact = ref.moe_exact(x.cpu(), w13, s13, parts[("w2", "weight")], parts[("w2", "scale")], tw.cpu(),
                              ids.cpu(), limit=limit, scaling=scaling)
        rel = float((y.cpu().double() - exact).norm() / exact.norm())
        outputs[name] = y.cpu()
        record["layers"].append({"name": name, "method": type(mod.quant_method).__name__, "rel_err_vs_exact": rel,
                                 "first_call_s": round(first_call_s, 2)})
        print(f"  {name}: {type(mod.quant_method).__name__}: ||y - exact|| / ||exact|| = {rel:.3e} "
              f"(first call {first_call_s:.1f} s)", flush=True)
    torch.save(outputs, args.out)
    if args.compare:
        other = torch.load(args.compare)
        record["vs_other"] = {n: float((outputs[n].double() - other[n].double()).norm() / other[n].double().norm())
                              for n in outputs if n in other}
    with open(args.out + ".json", "w") as f:
        json.dump(record, f, indent=1)
    fp = record["footprint"]
    print(f"moe_check: {record['gpu']} backend={record['backend']} {len(layers)} expert layers; resident "
          f"{fp['bytes']} bytes, 4 bits + E8M0/32 = {fp['expected']}; load {record['load_s']} s")
    worst = max(r["rel_err_vs_exact"] for r in record["layers"])
    print(f"  worst ||y - exact|| / ||exact||: {worst:.3e}")
    if "vs_other" in record:
        print(f"  vs {args.compare}: worst relative difference {max(record['vs_other'].values()):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
