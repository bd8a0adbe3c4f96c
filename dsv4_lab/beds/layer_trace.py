"""GPU: one prompt's prefill recorded module by module (dsv4_lab/trace.py) through SGLang's own forward
hooks, on whatever path the environment selects (native with the patch off, the SM80 path in lab mode).
Two such traces of the same ids compared (`python -m dsv4_lab.trace A B`) name the first module whose
output differs much more than its input: where the SM80 path and native part ways.

    ENABLE_SGLANG_DSV4_A100_PATCH=0 python -m dsv4_lab.beds.layer_trace --out-dir $OUT/trace-native
    ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB_CC=9.0 DSV4_SM80_LAB_GPU_COUNT=1 \
        python -m dsv4_lab.beds.layer_trace --out-dir $OUT/trace-patched
    python -m dsv4_lab.trace $OUT/trace-native $OUT/trace-patched

Eager only (SGLang registers the hooks after graph capture, and graph replays run no Python hooks); a first
request of 4 tokens arms the keyword-argument pre-hooks (dsv4_lab.trace.factory), then the prompt runs once with one
new token: its prefill is the traced forward.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--ckpt", default="/tmp/dsv4-tiny")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--head-scale", type=float, default=None)
    ap.add_argument("--length", type=int, default=300, help="prompt ids (the engine_bed prompt of that length)")
    ap.add_argument("--moe-runner-backend", default="marlin")
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--perturb", type=float, default=0.0,
                    help="the embedding output moved one BF16 ulp in this share of entries (dsv4_lab.perturb): "
                         "the floor trace")
    args = ap.parse_args(argv)

    from dsv4_lab.beds.engine_bed import BED_WATCHDOG_S, prompt_ids
    from dsv4_lab.perturb import perturb_spec
    from dsv4_lab.trace import trace_spec
    from dsv4_sm80 import env
    from dsv4_sm80.tiny.generate import ensure, head_scale_for

    args.head_scale = head_scale_for(args.preset, args.head_scale)  # peaked outputs at every width
    ensure(args.ckpt, args.preset, head_scale=args.head_scale)
    config = json.load(open(os.path.join(args.ckpt, "config.json")))
    ids = prompt_ids(args.length, int(config["vocab_size"]), seed=7)
    for old in glob.glob(os.path.join(args.out_dir, "forward-*.pt")):
        os.remove(old)

    import sglang

    t0 = time.time()
    engine = sglang.Engine(
        model_path=args.ckpt, skip_tokenizer_init=True, moe_runner_backend=args.moe_runner_backend,
        disable_cuda_graph=True, mem_fraction_static=args.mem_fraction, random_seed=0, log_level="warning",
        watchdog_timeout=BED_WATCHDOG_S,
        # weights too (dsv4_lab.trace --linears); the perturbation first, so the trace records the moved embedding
        forward_hooks=((perturb_spec(args.perturb) if args.perturb else [])
                       + trace_spec(args.out_dir, rows=len(ids), params=True)),
    )
    start = time.time() - t0
    try:
        one = {"temperature": 0.0, "max_new_tokens": 1}
        engine.generate(input_ids=[11, 12, 13, 14], sampling_params=one)  # arms the pre-hooks
        out = engine.generate(input_ids=ids, sampling_params=one)
    finally:
        engine.shutdown()
    files = sorted(glob.glob(os.path.join(args.out_dir, "forward-*.pt")))
    import torch

    n = len(torch.load(files[0], weights_only=False)) if files else 0
    ok = bool(files) and n > 0
    print(f"layer_trace: patch={'on' if env.patch_enabled() else 'off'} {args.length} ids, engine start {start:.1f} s, "
          f"next token {out['output_ids']}; {len(files)} trace file(s), {n} modules recorded -> {args.out_dir}")
    if not ok:
        print("layer_trace: FAILED: no forward of that many tokens was recorded (did SGLang pad or chunk the prefill?)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
