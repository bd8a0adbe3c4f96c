"""GPU test bed for the accuracy rule: one engine, several teacher-forced runs of the same held-out prompts.

    ENABLE_SGLANG_DSV4_A100_PATCH=0 python -m dsv4_lab.beds.accuracy_bed --ckpt CKPT --prompts P.json \\
        --out-dir D --runs native,native-reversed
    ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB=1 DSV4_SM80_LAB_CC=9.0 DSV4_SM80_LAB_GPU_COUNT=1 \\
        DSV4_SM80_LAB_MUTANT=runtime python -m dsv4_lab.beds.accuracy_bed --ckpt CKPT --prompts P.json \\
        --out-dir D --runs sm80,mutant-kv_store_skip_last,mutant-indexer_topk_511

P.json is a list of id lists (`python -m dsv4_lab.train prompts`). Each run teacher-forces every prompt in one
batch and writes D/<run>.json with a `teacher` list as `python -m dsv4_lab.oracle compare` reads it (per position
the input id's log-prob and the top --top ids). A run named `...-reversed` sends the prompts in reverse order (the
negative control: the same engine in another batch composition). A run named `mutant-NAME` switches that
mutant on for its own requests (the engine started with DSV4_SM80_LAB_MUTANT=runtime; this bed points
DSV4_SM80_LAB_MUTANT_FILE at a file and writes NAME into it, every wrapper reads it per call) and off after.
The prefix cache is off, so no run reads KV another run wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from dsv4_lab.beds.engine_bed import BED_WATCHDOG_S, bed_env, teacher_entry, write_record


def switch_to(path: str, name: str) -> None:
    """The mutant the engine's wrappers see from their next call on: written whole, then renamed."""
    with open(path + ".tmp", "w") as f:
        f.write(name)
    os.replace(path + ".tmp", path)


def run_plan(runs: list[str], mutants: dict, started_with: str) -> list[tuple[str, str, bool]]:
    """(run name, mutant to switch on, prompts reversed) per run. A mutant run needs a per-call mutant in an engine
    started with DSV4_SM80_LAB_MUTANT=runtime, or the very mutant the engine was started with (a load-time one:
    then it is the engine's only run)."""
    plan = []
    for run in runs:
        mutant = run.removeprefix("mutant-") if run.startswith("mutant-") else ""
        if started_with not in ("", "runtime"):
            if runs != [f"mutant-{started_with}"]:
                raise SystemExit(f"accuracy_bed: an engine started with mutant {started_with} serves one run, "
                                 f"mutant-{started_with}; found runs {runs}")
            return [(run, "", False)]  # the bug is in the loaded weights already
        if mutant and (mutant not in mutants or not mutants[mutant].runtime or started_with != "runtime"):
            switchable = sorted(n for n, m in mutants.items() if m.runtime)
            raise SystemExit(f"accuracy_bed: run {run!r} needs an engine started with DSV4_SM80_LAB_MUTANT=runtime "
                             f"and one of {', '.join(switchable)} (the others need an engine started with their "
                             f"name); found DSV4_SM80_LAB_MUTANT={started_with!r}")
        plan.append((run, mutant, run.endswith("-reversed")))
    return plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of id lists (python -m dsv4_lab.train prompts)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--runs", required=True, help="comma-separated run names (see above)")
    ap.add_argument("--top", type=int, default=20, help="top ids recorded per position (as the oracle's --top)")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--moe-runner-backend", default="marlin", help="native SM90 needs marlin")
    args = ap.parse_args(argv)

    from dsv4_lab import mutants

    plan = run_plan(args.runs.split(","), mutants.MUTANTS, os.environ.get(mutants.KNOB, ""))
    prompts = [[int(x) for x in p] for p in json.load(open(args.prompts))]
    switch = None
    if any(m for _, m, _ in plan):
        switch = os.path.join(tempfile.mkdtemp(prefix="dsv4-mutant-"), "mutant")
        switch_to(switch, "")
        os.environ[mutants.SWITCH_FILE] = switch  # the scheduler processes inherit it

    import sglang
    import torch

    t0 = time.time()
    engine = sglang.Engine(model_path=args.ckpt, skip_tokenizer_init=True, tp_size=1,
                           moe_runner_backend=args.moe_runner_backend, disable_cuda_graph=True,
                           disable_radix_cache=True, mem_fraction_static=args.mem_fraction,
                           max_total_tokens=args.max_total_tokens, random_seed=0, log_level="warning",
                           watchdog_timeout=BED_WATCHDOG_S)
    start_s = round(time.time() - t0, 1)
    os.makedirs(args.out_dir, exist_ok=True)
    try:
        for name, mutant, reverse in plan:
            if switch:
                switch_to(switch, mutant)
            order = list(range(len(prompts)))[::-1] if reverse else list(range(len(prompts)))
            t0 = time.time()
            outs = engine.generate(input_ids=[prompts[i] for i in order],
                                   sampling_params={"temperature": 0.0, "max_new_tokens": 1}, return_logprob=True,
                                   logprob_start_len=[0] * len(order), top_logprobs_num=args.top)
            by_prompt = dict(zip(order, outs))
            record = {"patch": os.environ.get("ENABLE_SGLANG_DSV4_A100_PATCH"), "run": name, "mutant": mutant,
                      "reversed": reverse, "env": bed_env(), "gpu": torch.cuda.get_device_name(0),
                      "sglang": sglang.__version__, "ckpt": args.ckpt, "engine_start_s": start_s,
                      "seconds": round(time.time() - t0, 1),
                      "teacher": [teacher_entry(p, by_prompt[i]["meta_info"]) for i, p in enumerate(prompts)]}
            write_record(os.path.join(args.out_dir, f"{name}.json"), record)
            print(f"accuracy_bed: {name}: {len(prompts)} prompts, {sum(map(len, prompts))} ids, "
                  f"{record['seconds']} s")
    finally:
        if switch:
            switch_to(switch, "")
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
