"""End to end: decode tokens/s and time to first token, the patched SM80 datapath vs native SGLang, in
one run, on a full-width checkpoint (DSV4-Flash widths, few layers: `make-tiny --preset wide`) or, patched modes
only, the full-depth one at one TP4 rank's widths (`--preset full`: 43 layers, TP1).

Each path runs in its own process (the patch state is read at interpreter start): `--child native`
with ENABLE_SGLANG_DSV4_A100_PATCH=0 (SGLang's SM90 path: FP8, MXFP4 Marlin, FlashMLA) and `--child
patched` with the patch on, in lab mode on an SM90 GPU (an explicit override of the gate, never a default),
without the capability override on an SM80 one (there: no native mode, it does not run on SM80).
Both use CUDA graphs (SGLang's defaults for DSV4), TP1, the tokenizer skipped, greedy sampling with EOS
ignored so every request decodes exactly --decode tokens.

    python bench/e2e.py --ckpt /tmp/dsv4-wide --out e2e.json      (an H200 prints H200 numbers)
    python bench/e2e.py --preset full --ckpt /tmp/dsv4-full --modes patched,patched-fp8 --batches 1,16,64 \
        --out full.json

Measured per batch size (1 and 16 by default), best of --reps:
  TTFT      wall time of a generate() of --prompt-len ids with max_new_tokens=1 (the batch at once)
  decode    (time of max_new_tokens=--decode) - TTFT, as batch * (decode - 1) / that time  [tok/s]
  GB/s      the weight bytes one decode step reads (dense linears and head whole in the mode's format, the
            routed experts each token batch touches on average: E * (1 - (1 - k/E)^batch) of E per layer) per
            step time, against the device-copy peak measured in the same run (KV reads are left out: at these
            lengths under 1 % of the step's bytes)
The goal of the end-to-end issue: patched / native decode >= 0.9.

Modes (--modes, comma-joined): native; patched (the image defaults); patched-marlin (routed experts on SGLang's
MXFP4 Marlin, W4A16) and patched-fp8 (dense linears on FP8-Marlin) to tell which stage a gap comes from.
--profile DIR: after the timings, each mode's engine records --profile-steps decode steps of each batch with
SGLang's own profiler (Engine.start_profile by stage, GPU activity only) into DIR/MODE/bBATCH; the tables printed
(one per batch) are the GPU time per decode step by kernel, each mode's top kernels and its total against native's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB = {"ENABLE_SGLANG_DSV4_A100_PATCH": "1", "DSV4_SM80_LAB_CC": "9.0", "DSV4_SM80_LAB": "1",
       "DSV4_SM80_TRIPWIRE": "1"}  # the patched path runs with every SM90-only entry point raising
# each patched mode: the SM80 path with one stage switched to its other backend (README, environment)
MODES = {"native": None, "patched": {},
         "patched-marlin": {"SGLANG_DSV4_MXFP4_MOE_BACKEND": "marlin"},
         "patched-fp8": {"SGLANG_DSV4_A100_DENSE": "fp8_marlin"}}


def gpu_cc() -> str | None:
    """The first GPU's compute capability ("8.0", "9.0") from nvidia-smi (no CUDA context in this process);
    None where it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def mode_env(mode: str, tp: int, base: dict, cc: str | None = None) -> dict:
    """The environment of one mode's child process. cc: the GPU's compute capability; on SM80 (an A800, the
    product's own GPU) the patched modes run without the lab's capability override, which the gate would
    refuse there."""
    if mode not in MODES:
        raise SystemExit(f"e2e bench: unknown mode {mode!r}; known: {', '.join(MODES)}")
    env = dict(base, PYTHONPATH=ROOT + os.pathsep + base.get("PYTHONPATH", ""), SGLANG_JIT_DEEPGEMM_PRECOMPILE="0")
    if MODES[mode] is None:
        env["ENABLE_SGLANG_DSV4_A100_PATCH"] = "0"
        return env
    env.update(LAB)
    if cc is not None and cc.startswith("8."):
        env.pop("DSV4_SM80_LAB_CC")
    env.update(MODES[mode])
    env.pop("DSV4_SM80_LAB_GPU_COUNT", None)  # an inherited override must not outvote --tp
    if tp != 4:  # 4 is the gate's production count: no override needed
        env["DSV4_SM80_LAB_GPU_COUNT"] = str(tp)
    return env


def native_refusal(config: dict, tp: int) -> str | None:
    """Why native SGLang cannot decode this checkpoint at this TP size, or None. FlashMLA's sparse decode takes 64
    or 128 query heads, and SGLang pads a rank's heads to 64 only above TP1 (deepseek_v4.py:1110-1115): the `full`
    preset's 16 heads at TP1 would reach FlashMLA unpadded."""
    heads = int(config["num_attention_heads"])
    if tp == 1 and heads not in (64, 128):
        return f"{heads} query heads at TP1 (FlashMLA takes 64 or 128; SGLang pads only above TP1)"
    return None


DENSE_OF_MODE = {"native": "native", "patched": "bf16", "patched-marlin": "bf16", "patched-fp8": "fp8_marlin"}


def step_bytes(config: dict, tp: int, mode: str, batch: int) -> float:
    """Weight bytes one GPU reads per decode step of `batch` tokens in `mode` (footprint.weights' per-rank
    arithmetic of the checkpoint): every dense linear, norm and the head, plus the expected share of routed
    experts touched (uniform routing, num_experts_per_tok of n_routed_experts per token), plus `batch`
    embedding rows. The draft model is not counted (no speculation here)."""
    from dsv4_sm80.footprint import weights

    w = weights(config, tp=tp, dense=DENSE_OF_MODE[mode])["main"]
    e, k = int(config["n_routed_experts"]), int(config["num_experts_per_tok"])
    touched = 1.0 - (1.0 - k / e) ** batch
    rest = sum(v for c, v in w.items() if c not in ("experts", "embedding"))
    return rest + w.get("experts", 0.0) * touched + batch * int(config["hidden_size"]) * 2


def measured_copy_gbps() -> float | None:
    """The device-copy peak (bench/common.py), measured in a process of its own so that no CUDA context stays
    in this one beside the engines; None where it fails."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import json, sys; sys.path.insert(0, {here!r}); import common; "
            "print('PEAK', json.dumps(common.copy_gbps()))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout
        line = next((x for x in out.splitlines() if x.startswith("PEAK ")), None)
        return float(json.loads(line[5:])) if line else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def kernel_times(trace_paths: list) -> dict:
    """Total GPU time (us) per kernel name over chrome traces (torch profiler's export, .json or .json.gz):
    events of category 'kernel' (CUDA-graph replays included: CUPTI records each kernel of a graph)."""
    import gzip

    total = {}
    for path in trace_paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for e in events:
            if e.get("cat") == "kernel" and e.get("ph") == "X":
                total[e["name"]] = total.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    return total


def profile_table(per_mode: dict, steps: int, top: int = 12) -> list:
    """Lines: per mode, its GPU time per decode step and its `top` kernels (us per step, share)."""
    lines = []
    nat = sum(per_mode.get("native", {}).values()) / steps if per_mode.get("native") else None
    for mode, times in per_mode.items():
        step = sum(times.values()) / steps
        ratio = f" ({step / nat:.2f}x native)" if nat and mode != "native" else ""
        lines.append(f"{mode}: {step:.1f} us of kernels per decode step{ratio}")
        for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {t / steps:9.1f} us {100 * t / max(sum(times.values()), 1e-9):5.1f} %  {name[:110]}")
    return lines


def profile_report(root: str, modes: list, batches: list, steps: int, results: dict) -> tuple:
    """(lines, record): per batch, each mode's kernels per decode step from its traces under ROOT/MODE/bBATCH
    (profile_table), and the top 40 kernels' times per batch and mode for the record; a mode without a trace
    says so, with the profile error its child reported."""
    lines, record = [], {}
    for b in batches:
        per_mode = {}
        for mode in modes:
            paths = glob.glob(os.path.join(root, mode, f"b{b}", "*DECODE*.json*"))
            if paths:
                per_mode[mode] = kernel_times(paths)
            else:
                err = results.get(mode, {}).get("profile_errors", {}).get(str(b), "")
                lines.append(f"e2e {mode}: no profile trace at batch {b} {err}".rstrip())
        lines.append(f"kernels per decode step (batch {b}, {steps} steps recorded by SGLang's profiler)")
        lines += profile_table(per_mode, steps)
        record[b] = {m: dict(sorted(t.items(), key=lambda kv: -kv[1])[:40]) for m, t in per_mode.items()}
    return lines, record


def child(args) -> dict:
    sys.path.insert(0, ROOT)
    import random

    import sglang
    import torch

    from dsv4_lab.beds.engine_bed import BED_WATCHDOG_S

    vocab = int(json.load(open(os.path.join(args.ckpt, "config.json")))["vocab_size"])
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, min(vocab, 128000)) for _ in range(args.prompt_len)]
               for _ in range(max(args.batches))]
    t0 = time.time()
    # graphs captured up to the largest measured batch only (SGLang's default captures far more: minutes at start)
    engine = sglang.Engine(model_path=args.ckpt, skip_tokenizer_init=True, tp_size=args.tp, moe_runner_backend="marlin",
                           mem_fraction_static=args.mem_fraction, random_seed=0, log_level=args.log_level,
                           cuda_graph_max_bs_decode=max(args.batches),
                           watchdog_timeout=BED_WATCHDOG_S)  # a cold first forward compiles for minutes
    out = {"mode": args.child, "gpu": torch.cuda.get_device_name(0), "engine_start_s": time.time() - t0, "rows": []}
    try:
        def timed(batch, new):
            params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
            best = float("inf")
            for _ in range(args.reps):
                t = time.perf_counter()
                res = engine.generate(input_ids=prompts[:batch], sampling_params=params)
                best = min(best, time.perf_counter() - t)
                assert all(len(r["output_ids"]) == new for r in res), [len(r["output_ids"]) for r in res]
            return best

        timed(max(args.batches), 4)  # warm-up: compile caches, graphs
        for b in args.batches:
            ttft = timed(b, 1)
            total = timed(b, args.decode)
            out["rows"].append({"batch": b, "ttft_s": ttft, "total_s": total,
                                "decode_tok_s": b * (args.decode - 1) / max(total - ttft, 1e-9)})
        if args.profile:
            # SGLang's profiler by stage: the prefill and the first --profile-steps decode steps of each batch,
            # each stage in its own trace file (*-EXTEND, *-DECODE) under MODE/bBATCH; it stops itself after the
            # steps (scheduler_components/profiler_manager.py _profile_batch_predicate), so no stop_profile here.
            # A profile that fails is said in the record; the timed rows above stand.
            out["profile_dirs"] = {}
            for b in args.batches:
                d = os.path.join(args.profile, args.child, f"b{b}")
                try:
                    os.makedirs(d, exist_ok=True)
                    engine.start_profile(output_dir=d, activities=["GPU"], with_stack=False, record_shapes=False,
                                         profile_by_stage=True, num_steps=args.profile_steps)
                    params = {"temperature": 0.0, "max_new_tokens": args.profile_steps + 4, "ignore_eos": True}
                    engine.generate(input_ids=prompts[:b], sampling_params=params)
                    out["profile_dirs"][b] = d
                except Exception as e:
                    out.setdefault("profile_errors", {})[b] = f"{type(e).__name__}: {e}"[:500]
    finally:
        engine.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="/tmp/dsv4-wide")
    ap.add_argument("--preset", default="wide", choices=("wide", "full"),
                    help="what --ckpt is generated from when it holds no checkpoint: wide (4 layers at full width) "
                         "or full (43 layers at one TP4 rank's widths, patched modes only: --modes patched,...)")
    ap.add_argument("--out")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument("--modes", default="native,patched")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (4: the production topology)")
    ap.add_argument("--log-level", default="warning", help="the engine's (info: load and capture progress)")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds per path (a stuck start fails alone)")
    ap.add_argument("--profile",
                    help="a folder: each mode's kernels over --profile-steps decode steps (SGLang's profiler)")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--child", choices=tuple(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in str(args.batches).split(",")]
    if args.child:
        print("E2E_RESULT " + json.dumps(child(args)), flush=True)
        return 0

    sys.path.insert(0, ROOT)
    from dsv4_sm80.tiny.generate import PEAKED_HEAD_SCALE, PRESETS, ensure, tiny_config

    modes = args.modes.split(",")
    for mode in modes:
        mode_env(mode, args.tp, {})  # unknown modes refused before anything is generated or started
    config_path = os.path.join(args.ckpt, "config.json")
    planned = json.load(open(config_path)) if os.path.isfile(config_path) else tiny_config(PRESETS[args.preset])
    if "native" in modes and (why := native_refusal(planned, args.tp)):  # before tens of GB are generated
        raise SystemExit(f"e2e bench: native mode: {why}; run --modes patched,... on this checkpoint")
    # as `python -m dsv4_sm80 make-tiny DIR --preset PRESET` with the preset's peaked head, unless DIR holds one
    ensure(args.ckpt, args.preset, fast_experts=True, head_scale=PEAKED_HEAD_SCALE[args.preset])
    config = json.load(open(config_path))
    results = {}
    cc = gpu_cc()
    peak = measured_copy_gbps()
    for mode in modes:
        env = mode_env(mode, args.tp, dict(os.environ), cc)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--ckpt", args.ckpt,
               "--batches", ",".join(map(str, args.batches)), "--prompt-len", str(args.prompt_len),
               "--decode", str(args.decode), "--reps", str(args.reps), "--mem-fraction", str(args.mem_fraction),
               "--tp", str(args.tp), "--log-level", args.log_level]
        if args.profile:
            cmd += ["--profile", os.path.abspath(args.profile), "--profile-steps", str(args.profile_steps)]
        # its own process group: on a timeout the engine's TP workers go with it, or they would keep the
        # GPUs' memory and stall the next path
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            print(f"e2e {mode}: no result (over --child-timeout {args.child_timeout} s); its last output:\n"
                  f"{stderr[-2500:]}")
            results[mode] = {"error": "timeout", "stderr_tail": stderr[-3000:]}
            continue
        for x in (stdout + stderr).splitlines():
            if "dsv4-sm80 footprint" in x:  # the start-up footprint line of each rank
                print(f"e2e {mode}: {x.strip()}")
        line = next((x for x in stdout.splitlines() if x.startswith("E2E_RESULT ")), None)
        if line is None:
            print(f"e2e {mode}: no result (exit {proc.returncode})\n{stderr[-3000:]}")
            results[mode] = {"error": stderr[-3000:]}
            continue
        results[mode] = json.loads(line[len("E2E_RESULT "):])
    print(f"e2e bench ({args.ckpt}; TP{args.tp}; prompt {args.prompt_len} ids, decode {args.decode} tokens, "
          "CUDA graphs on)")
    print(f"device copy peak {peak:.0f} GB/s (measured now)" if peak else "device copy peak: not measured")
    print(f"{'batch':>5s} {'mode':>14s} {'TTFT ms':>9s} {'decode tok/s':>13s} {'step ms':>8s} {'GB/step':>8s} "
          f"{'GB/s (%pk)':>12s} {'patched/native':>15s}")
    for i, b in enumerate(args.batches):
        nat = results.get("native", {}).get("rows", [None] * len(args.batches))[i]
        for mode in modes:
            r = results.get(mode, {}).get("rows", [None] * len(args.batches))[i]
            if r is None:
                continue
            step = b / r["decode_tok_s"]  # seconds per decode step of the whole batch
            r["step_bytes"] = step_bytes(config, args.tp, mode, b)
            r["gbps"] = r["step_bytes"] / step / 1e9
            pct = f" ({100 * r['gbps'] / peak:3.0f}%)" if peak else ""
            ratio = (f"{r['decode_tok_s'] / nat['decode_tok_s']:.2f} decode, "
                     f"{nat['ttft_s'] / r['ttft_s']:.2f} TTFT") if mode != "native" and nat else ""
            print(f"{b:5d} {mode:>14s} {r['ttft_s'] * 1e3:9.1f} {r['decode_tok_s']:13.1f} {step * 1e3:8.2f} "
                  f"{r['step_bytes'] / 1e9:8.2f} {r['gbps']:6.0f}{pct:>6s} {ratio:>15s}")
    profile = None  # beside the modes' results in the record, not one of them
    if args.profile:
        lines, profile = profile_report(args.profile, modes, args.batches, args.profile_steps, results)
        print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "copy_gbps": peak, "results": results, "profile": profile}, f, indent=1)
    return 0 if measured_all(results, modes) else 1


def measured_all(results: dict, modes: list) -> bool:
    """Every mode asked for has its rows (the profile's kernel table is kept beside the modes' results, not
    among them, where it would count as a mode without rows)."""
    return all("rows" in results.get(m, {}) for m in modes)


if __name__ == "__main__":
    sys.exit(main())
