"""GPU test bed for the trained tiny checkpoint (`dsv4_lab/train`): one serving path, one record.

    ENABLE_SGLANG_DSV4_A100_PATCH=0 python -m dsv4_lab.beds.trained_bed --ckpt CKPT --out native.json
    ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB_CC=9.0 DSV4_SM80_LAB_GPU_COUNT=1 \\
        python -m dsv4_lab.beds.trained_bed --ckpt CKPT --out sm80.json [--speculative-algorithm DSPARK]

Every prompt is held-out text of this machine's Python library (`dsv4_lab.train.data.held_out_prompts`), stored
in the record so the scorer (`python -m dsv4_lab.train score`) reads the same ids. What it records:
- windows: teacher-forced log-probs of each window's next ids (held-out bits per byte); not under DSPARK, which
  answers return_logprob with an abort in SGLang 0.5.16;
- greedy: continuations of --greedy prompts, batched (exact-match length against the reference's greedy;
  under DSPARK also the acceptance per request);
- long: one prompt decoded --long-new ids at temperature 0 and at 0.7 (drift of the text's NLL under the
  reference);
- speed: decode ids per second at batch 1 (a --speed-new-id decode's time less a one-id request's, the
  prefill), the mean of --speed-reps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from dsv4_lab.beds.engine_bed import BED_WATCHDOG_S, bed_env, spec_info, write_record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True, help="the unpacked trained checkpoint (python -m dsv4_lab.train unpack)")
    ap.add_argument("--windows", type=int, default=8, help="teacher-forced held-out windows")
    ap.add_argument("--window-len", type=int, default=3000, help="ids per window (> 2,048: the C4 indexer selects)")
    ap.add_argument("--greedy", type=int, default=16, help="greedy prompts")
    ap.add_argument("--greedy-len", type=int, default=256)
    ap.add_argument("--greedy-new", type=int, default=128)
    ap.add_argument("--long-len", type=int, default=256)
    ap.add_argument("--long-new", type=int, default=2000)
    ap.add_argument("--speed-new", type=int, default=256)
    ap.add_argument("--speed-reps", type=int, default=3)
    ap.add_argument("--moe-runner-backend", default="marlin", help="native SM90 needs marlin")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--speculative-algorithm", help="DSPARK: the trained draft stages in the checkpoint")
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--max-total-tokens", type=int, help="cap the KV pool: engines sharing one GPU each take only this")
    args = ap.parse_args(argv)

    from dsv4_lab.train import data
    from dsv4_sm80 import env

    lens = [args.window_len] * args.windows + [args.greedy_len] * args.greedy + [args.long_len]
    prompts = data.held_out_prompts(lens)
    windows, greedy = prompts[:args.windows], prompts[args.windows:args.windows + args.greedy]
    long_prompt = prompts[-1]

    import platform

    import sglang
    import torch

    spec = bool(args.speculative_algorithm)
    record = {"patch": env.patch_enabled(), "speculative": args.speculative_algorithm,
              "env": bed_env(),
              "gpu": torch.cuda.get_device_name(0), "sglang": sglang.__version__, "python": platform.python_version(),
              "ckpt": args.ckpt, "args": vars(args), "timings": {}}
    extra = {"speculative_algorithm": args.speculative_algorithm} if spec else {}
    if args.max_total_tokens:
        extra["max_total_tokens"] = args.max_total_tokens
    t0 = time.time()
    engine = sglang.Engine(model_path=args.ckpt, skip_tokenizer_init=True, tp_size=1,
                           moe_runner_backend=args.moe_runner_backend, disable_cuda_graph=args.no_cuda_graph,
                           mem_fraction_static=args.mem_fraction, random_seed=0, log_level="warning",
                           watchdog_timeout=BED_WATCHDOG_S, **extra)
    record["timings"]["engine_start_s"] = round(time.time() - t0, 1)
    try:
        if not spec:
            t0 = time.time()
            tf = engine.generate(input_ids=windows, sampling_params={"temperature": 0.0, "max_new_tokens": 1},
                                 return_logprob=True, logprob_start_len=[0] * len(windows))
            record["timings"]["windows_s"] = round(time.time() - t0, 1)
            record["windows"] = [{"ids": w, "logprobs": [e[0] for e in r["meta_info"]["input_token_logprobs"]]}
                                 for w, r in zip(windows, tf)]
        t0 = time.time()
        outs = engine.generate(input_ids=greedy, sampling_params={"temperature": 0.0, "ignore_eos": True,
                                                                   "max_new_tokens": args.greedy_new})
        record["timings"]["greedy_s"] = round(time.time() - t0, 1)
        record["greedy"] = [{"prompt": p, "output_ids": o["output_ids"], "spec": spec_info(o["meta_info"])}
                            for p, o in zip(greedy, outs)]
        record["long"] = []
        for temp in (0.0, 0.7):
            t0 = time.time()
            o = engine.generate(input_ids=long_prompt, sampling_params={"temperature": temp, "ignore_eos": True,
                                                                         "max_new_tokens": args.long_new})
            record["long"].append({"temperature": temp, "prompt": long_prompt, "output_ids": o["output_ids"],
                                   "seconds": round(time.time() - t0, 2), "spec": spec_info(o["meta_info"])})
        rates = []
        for _ in range(args.speed_reps):
            t0 = time.time()
            engine.generate(input_ids=greedy[0], sampling_params={"temperature": 0.0, "max_new_tokens": 1})
            t1 = time.time()
            o = engine.generate(input_ids=greedy[0], sampling_params={"temperature": 0.0, "ignore_eos": True,
                                                                       "max_new_tokens": args.speed_new + 1})
            t2 = time.time()
            rates.append(args.speed_new / max(1e-9, (t2 - t1) - (t1 - t0)))
        record["speed"] = {"batch1_decode_ids_per_s": statistics.mean(rates), "reps": rates,
                           "spec": spec_info(o["meta_info"])}
    finally:
        engine.shutdown()
    write_record(args.out, record)
    acc = [g["spec"].get("spec_accept_length") for g in record["greedy"] if g["spec"]]
    print(f"trained_bed: patch={'on' if record['patch'] else 'off'} spec={args.speculative_algorithm} "
          f"gpu={record['gpu']} timings={record['timings']} batch-1 decode "
          f"{record['speed']['batch1_decode_ids_per_s']:.1f} ids/s"
          + (f" accept length mean {statistics.mean(acc):.2f}" if acc else "") + f" -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
