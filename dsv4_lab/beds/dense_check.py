"""GPU check of the dense stage on the whole tiny model: SGLang 0.5.16's own ModelRunner loads the
checkpoint in this process (TP1, the patch state from the environment), then every dense linear is
checked against a float64 reference decoded from the checkpoint's bytes (tests/reference.py).

    ENABLE_SGLANG_DSV4_A100_PATCH=1 SGLANG_DSV4_A100_DENSE=bf16 \
        python -m dsv4_lab.beds.dense_check --out $OUT/dense-bf16.json
    ENABLE_SGLANG_DSV4_A100_PATCH=1 SGLANG_DSV4_A100_DENSE=fp8_marlin \
        python -m dsv4_lab.beds.dense_check --out $OUT/dense-marlin.json

Asserted, per linear of the target model that the checkpoint stores as FP8 blocks (fused wqkv_a =
wq_a + wkv, wq_b, wo_a, wo_b, indexer wq_b, shared experts gate_up = w1 + w3 and down = w2):
- bf16: method Sm80Bf16LinearMethod, weight BF16 and bit-equal to the reference dequantization,
  scale freed; the module's output equals F.linear(x, reference weight) exactly.
- fp8_marlin: SGLang's Fp8LinearMethod with Marlin on (also on this SM90 GPU), weight repacked to
  int32 at 1 byte per weight, its output within BF16 rounding of the fp32 reference product;
  wo_a stays BF16 as in bf16 mode.
- the after-load state check of the patch passed (no linear on the native FP8 path), and peak GPU
  memory during loading.
The DSPARK draft's linears load with the draft worker; engine_bed's load report covers them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# module-name pattern -> checkpoint FP8 linears whose rows it holds, in order
CKPT_OF = (
    (r"model\.layers\.(\d+)\.self_attn\.wqkv_a$", ("layers.{}.attn.wq_a", "layers.{}.attn.wkv")),
    (r"model\.layers\.(\d+)\.self_attn\.wq_a$", ("layers.{}.attn.wq_a",)),
    (r"model\.layers\.(\d+)\.self_attn\.wkv$", ("layers.{}.attn.wkv",)),
    (r"model\.layers\.(\d+)\.self_attn\.(wq_b|wo_a|wo_b)$", ("layers.{}.attn.{}",)),
    (r"model\.layers\.(\d+)\.self_attn\.indexer\.wq_b$", ("layers.{}.attn.indexer.wq_b",)),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts\.gate_up_proj$",
     ("layers.{}.ffn.shared_experts.w1", "layers.{}.ffn.shared_experts.w3")),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj$", ("layers.{}.ffn.shared_experts.w2",)),
)


def checkpoint_parts(module_name: str):
    for pattern, parts in CKPT_OF:
        m = re.match(pattern, module_name)
        if m:
            return [p.format(*m.groups()) for p in parts]
    return None


def reference():
    """tests/reference.py, the float64 references the CPU tests share: tests/ is no package, so it is loaded from
    its file (once per process)."""
    if "reference" not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location("reference", os.path.join(ROOT, "tests", "reference.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["reference"] = mod
    return sys.modules["reference"]


def build_runner(ckpt: str, mem_fraction: float):
    """What sglang.benchmark.one_batch.load_model does for TP1, without the tokenizer."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs(model_path=ckpt, skip_tokenizer_init=True, tp_size=1, moe_runner_backend="marlin",
                             disable_cuda_graph=True, mem_fraction_static=mem_fraction, random_seed=0)
    _set_envs_and_config(server_args)
    initialize_moe_config(server_args)
    initialize_fp8_gemm_config(server_args)
    initialize_fp4_gemm_config(server_args)
    port_args = PortArgs.init_new(server_args)
    ps = ParallelState(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=None, dp_size=1,
                       attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1,
                       attn_dp_rank=0, attn_dp_size=1, moe_ep_rank=0, moe_ep_size=1,
                       moe_dp_rank=None, moe_dp_size=server_args.moe_dp_size, dcp_size=server_args.dcp_size,
                       gpu_id=0)
    return ModelRunner(model_config=ModelConfig.from_server_args(server_args), mem_fraction_static=mem_fraction,
                       gpu_id=0, ps=ps, nccl_port=port_args.nccl_port, server_args=server_args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default="/tmp/dsv4-tiny")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--head-scale", type=float, default=None)
    ap.add_argument("--tokens", type=int, default=37, help="rows of the random input to each linear")
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--stack-after", type=float, default=200.0,
                    help="dump every thread's stack after this many seconds (a stall shows where it is)")
    args = ap.parse_args(argv)

    import faulthandler

    faulthandler.dump_traceback_later(args.stack_after, exit=False)

    import numpy as np
    import torch
    import torch.nn.functional as F

    from dsv4_sm80 import env
    from dsv4_sm80.stages import dense as linear
    from dsv4_sm80.tiny.generate import ensure, head_scale_for
    dequant_fp8_bf16, load_raw = reference().dequant_fp8_bf16, reference().load_raw

    args.head_scale = head_scale_for(args.preset, args.head_scale)  # peaked outputs at every width
    ensure(args.ckpt, args.preset, head_scale=args.head_scale)

    patch, dense = env.patch_enabled(), env.get(env.DENSE)
    if not patch:
        print("dense_check: the patch is off; nothing of the dense stage to check")
        return 2
    torch.cuda.reset_peak_memory_stats()
    runner = build_runner(args.ckpt, args.mem_fraction)
    model = runner.model
    peak_load = torch.cuda.max_memory_allocated()
    rows = linear.check_dense_state(model)  # raises if anything is left on the native FP8 path
    print(f"dense_check: model loaded, {len(rows)} linears; checking against the reference", flush=True)

    record = {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
              "dense": dense, "peak_allocated_during_load": peak_load,
              "allocated_after_load": torch.cuda.memory_allocated(), "linears": [], "failures": []}
    fail = record["failures"].append
    mods = dict(model.named_modules())
    gen = torch.Generator(device="cuda").manual_seed(0)
    seen_ckpt = set()
    for row in rows:
        parts = checkpoint_parts(row["name"])
        if parts is None:
            if not row["method"].startswith("Unquantized"):
                fail(f"{row['name']}: {row['method']} on a linear the check does not know")
            continue
        seen_ckpt.update(parts)
        ref = np.concatenate([dequant_fp8_bf16(load_raw(args.ckpt, f"{p}.weight")[1],
                                               load_raw(args.ckpt, f"{p}.scale")[1]) for p in parts])
        n, k = ref.shape
        mod = mods[row["name"]]
        ref_w = torch.from_numpy(ref).to("cuda", torch.bfloat16)  # exact: ref is on the BF16 grid
        x = torch.randn(args.tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
        print(f"  {row['name']}: {row['method']} {row['dtype']} {n}x{k}", flush=True)
        y = mod.quant_method.apply(mod, x)
        y_ref32 = x.float() @ ref_w.float().t()
        y_bf16 = F.linear(x, ref_w)
        scale = y_ref32.abs().max()
        rec = dict(row, ckpt=parts, rel_err=float((y.float() - y_ref32).abs().max() / scale),
                   rel_err_bf16_gemm=float((y_bf16.float() - y_ref32).abs().max() / scale))
        always_bf16 = row["name"].endswith(linear.ALWAYS_BF16_SUFFIXES)
        if dense == "bf16" or always_bf16:
            rec["weight_exact"] = bool(mod.weight.dtype == torch.bfloat16 and torch.equal(mod.weight, ref_w))
            rec["output_exact"] = bool(torch.equal(y, y_bf16))
            ok = (row["method"] == "Sm80Bf16LinearMethod" and rec["weight_exact"] and rec["output_exact"]
                  and not hasattr(mod, "weight_scale_inv"))
        else:
            rec["weight_bytes"] = mod.weight.numel() * mod.weight.element_size()
            ok = (row["method"] == "Fp8LinearMethod" and row["marlin"] and mod.weight.dtype == torch.int32
                  and rec["weight_bytes"] == n * k and rec["rel_err"] <= 2.0 ** -7)
        rec["ok"] = bool(ok)
        if not ok:
            fail(f"{row['name']}: {rec}")
        record["linears"].append(rec)

    index = json.load(open(os.path.join(args.ckpt, "model.safetensors.index.json")))
    wanted = {name.rsplit(".", 1)[0] for name in index["weight_map"]
              if name.startswith("layers.") and name.endswith(".scale") and ".experts." not in name}
    if wanted != seen_ckpt:
        fail(f"FP8 linears of the checkpoint not found as modules: {sorted(wanted - seen_ckpt)}; "
             f"unexpected: {sorted(seen_ckpt - wanted)}")
    record["dense_resident_bytes"] = sum(r["bytes"] for r in rows if checkpoint_parts(r["name"]) is not None)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)

    checked = record["linears"]
    print(f"dense_check: {record['gpu']} sm{''.join(map(str, record['capability']))} dense={dense}: "
          f"{len(checked)} FP8 block linears checked, {sum(r['ok'] for r in checked)} ok; "
          f"methods {sorted({(r['method'], r['dtype']) for r in checked})}")
    print(f"  max rel err vs fp32 reference product: this path {max(r['rel_err'] for r in checked):.2e}, "
          f"BF16 GEMM of the reference weight {max(r['rel_err_bf16_gemm'] for r in checked):.2e}")
    print(f"  FP8-checkpoint linears resident {record['dense_resident_bytes'] / 2**20:.1f} MiB; GPU peak allocated "
          f"during load {peak_load / 2**20:.1f} MiB, after {record['allocated_after_load'] / 2**20:.1f} MiB")
    for line in record["failures"]:
        print("  FAIL", line)
    print("dense_check:", "OK" if not record["failures"] else "FAILED", "->", args.out)
    return 0 if not record["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
