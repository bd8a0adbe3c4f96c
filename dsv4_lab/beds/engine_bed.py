"""GPU test bed: real `sglang.Engine` (TP1, tokenizer skipped) on the tiny official-format checkpoint.

Runs on any CUDA machine where sglang 0.5.16 imports. The patch state comes from the environment
(ENABLE_SGLANG_DSV4_A100_PATCH, read by sitecustomize at interpreter start), so run it twice to A/B:

    ENABLE_SGLANG_DSV4_A100_PATCH=0 python -m dsv4_lab.beds.engine_bed --out native.json
    ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB_CC=9.0 DSV4_SM80_LAB_GPU_COUNT=1 \
        python -m dsv4_lab.beds.engine_bed --out patched.json --teacher-from native.json

What it records (JSON): greedy continuations of prompts of ~20, 300 and 3000 token ids (3000 makes
the C4 indexer select sparsely: the C4 pool exceeds index_topk=512 past 2048 tokens), batched and
one at a time, with their logprobs; and teacher-forced per-position top-k logprobs over fixed
sequences (prompt + continuation), the measure "same output as native" is judged by.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# SGLang's scheduler watchdog (ServerArgs.watchdog_timeout, 300 s) kills the engine when one forward takes longer;
# a cold machine's first forward compiles SGLang's JIT kernels for 7-9 minutes (on the H200, 2026-12-01: a native
# trace SIGKILLed by it at 7.5 minutes of compiling). The test beds allow that; serving keeps SGLang's default.
BED_WATCHDOG_S = 1800.0


def bed_env() -> dict:
    """The environment variables that decide the path a record was made on."""
    return {k: os.environ.get(k) for k in sorted(os.environ) if k.startswith(("SGLANG_", "ENABLE_SGLANG", "DSV4_SM80"))}


def spec_info(meta: dict) -> dict:
    """SGLang's speculative-decoding figures of one request (spec_accept_length, ...), the histogram left out."""
    return {k: v for k, v in meta.items() if k.startswith("spec_") and k != "spec_accept_histogram"}


def write_record(path: str, record: dict) -> None:
    """Written whole, then renamed: a job reading it while it is written (a compare beside a teacher-forcing run)
    must never see half of it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed * 1_000_003 + length)
    return [rng.randrange(1000, min(vocab, 128000)) for _ in range(length)]


def teacher_sequences(path: str) -> list[list[int]]:
    """The teacher-forced sequences of an earlier record."""
    if not os.path.isfile(path):
        raise SystemExit(f"engine_bed: teacher record {path} absent (its run failed or was cut: see its log)")
    return [r["sequence"] for r in json.load(open(path))["teacher"]]


def logprob_ids(spec, vocab: int, n_sequences: int):
    """--token-ids-logprob as one id list per teacher sequence (None without the option)."""
    if not spec:
        return None
    if spec == "all":
        return [list(range(vocab))] * n_sequences
    ids = json.load(open(spec))
    per_seq = ids if ids and isinstance(ids[0], list) else [ids] * n_sequences
    if len(per_seq) != n_sequences:
        raise SystemExit(f"engine_bed: --token-ids-logprob {spec} holds {len(per_seq)} id lists for "
                         f"{n_sequences} teacher sequences; expected one list, or one per sequence")
    return [sorted(int(i) for i in x) for x in per_seq]


def _ids_kw(ids):
    return {"token_ids_logprob": ids} if ids else {}


def _ids_rows(ids, entries):
    """SGLang's per-position (logprob, token_id, text) lists as log-prob rows in `ids` order (None at
    position 0, which has no prediction)."""
    rows = []
    for e in entries:
        if not e:
            rows.append(None)
            continue
        got = {x[1]: x[0] for x in e}
        rows.append([got[i] for i in ids])
    return rows


def teacher_entry(sequence: list[int], meta_info: dict, ids: list[int] | None = None) -> dict:
    """One teacher-forced sequence as `dsv4_lab.oracle.metrics` reads it, from SGLang's input log-probs:
    position 0 (and any before logprob_start_len, --prefix-hit) empty."""
    pad = len(sequence) - len(meta_info["input_token_logprobs"])
    out = {"sequence": sequence,
           "input_logprobs": [None] * pad + [e[0] for e in meta_info["input_token_logprobs"]],
           "top": [[]] * pad + [_pairs(x) if x else [] for x in meta_info["input_top_logprobs"]]}
    if ids:
        out.update(ids=ids, ids_logprobs=[None] * pad + _ids_rows(ids, meta_info["input_token_ids_logprobs"]))
    return out


def _pairs(entries):
    """SGLang logprob entries (logprob, token_id, text) -> [[token_id, logprob], ...]."""
    return [[e[1], e[0]] for e in entries if e is not None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default="/tmp/dsv4-tiny")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--head-scale", type=float, default=None,
                    help="LM-head scale of a generated checkpoint (default: the preset's peaked one, "
                    "generate.PEAKED_HEAD_SCALE; 1.0 = flat)")
    ap.add_argument("--lengths", default="20,300,3000")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--teacher-new", type=int, default=64)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--teacher-from", help="reuse the teacher-forced sequences of an earlier run")
    ap.add_argument("--moe-runner-backend", default="marlin",
                    help="native SM90 needs marlin (auto misroutes MXFP4 experts)")
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--cuda-graph-max-bs", type=int,
                    help="capture graphs up to this batch (fewer graphs: faster start)")
    ap.add_argument("--speculative-algorithm", help="e.g. DSPARK (draft stages bundled in the checkpoint)")
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--max-total-tokens", type=int,
                    help="cap the KV pool: engines sharing one GPU each take only this")
    ap.add_argument("--watchdog-timeout", type=float, default=BED_WATCHDOG_S,
                    help="SGLang's scheduler watchdog (its default 300 s: the suite's `cold` job measures a first "
                         "start with it)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel size (lab mode: DSV4_SM80_LAB_GPU_COUNT=N unless N is the production 4)")
    ap.add_argument("--teacher-mode", choices=("batched", "alone", "reversed"), default="batched",
                    help="how the teacher-forced sequences are submitted: a floor run should differ from the "
                         "oracle's batch composition (alone or reversed), or it measures only determinism")
    ap.add_argument("--token-ids-logprob", metavar="all|FILE",
                    help="also record, per teacher-forced position, SGLang's log-probs of these ids (SGLang's "
                         "token_ids_logprob): `all` (every id: small vocabularies only) or a JSON file with one id "
                         "list, or one per teacher sequence (`python -m dsv4_lab.oracle score --support-out`); "
                         "the lab oracle then computes KL exactly on those ids")
    ap.add_argument("--chunked-prefill-size", type=int,
                    help="SGLang's prefill chunk (an odd size splits C4/C128 windows and pages mid-way)")
    ap.add_argument("--prefix-hit", action="store_true",
                    help="first prefill each teacher sequence's first half, then teacher-force from that point "
                         "(logprob_start_len) so the half comes from the prefix cache; earlier positions stay empty")
    ap.add_argument("--prompts", metavar="FILE",
                    help="a JSON list of prompt id lists to use instead of random ids (--lengths and --batch then "
                         "ignored): held-out text for a trained checkpoint (`python -m dsv4_lab.train prompts`)")
    ap.add_argument("--batch", type=int, default=0,
                    help="N concurrent prompts cycling over --lengths (distinct ids); 0 = one per length")
    args = ap.parse_args(argv)

    from dsv4_sm80 import env

    patch = env.patch_enabled()
    from dsv4_sm80.tiny.generate import ensure, head_scale_for

    args.head_scale = head_scale_for(args.preset, args.head_scale)  # peaked outputs at every width
    ensure(args.ckpt, args.preset, head_scale=args.head_scale)
    config = json.load(open(os.path.join(args.ckpt, "config.json")))
    vocab = int(config["vocab_size"])
    lengths = [int(x) for x in args.lengths.split(",")]
    count = max(args.batch, len(lengths))
    lengths = [lengths[i % len(lengths)] for i in range(count)]
    prompts = [prompt_ids(n, vocab, seed=7 + i // len(set(lengths))) for i, n in enumerate(lengths)]
    if args.prompts:
        prompts = [[int(x) for x in p] for p in json.load(open(args.prompts))]
        lengths = [len(p) for p in prompts]

    import sglang
    import torch

    record = {
        "patch": patch, "env": bed_env(),
        "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
        "sglang": sglang.__version__, "torch": torch.__version__, "ckpt": args.ckpt,
        "config": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "n_routed_experts", "vocab_size", "compress_ratios")},
        "args": vars(args), "timings": {},
    }
    t0 = time.time()
    extra = {"speculative_algorithm": args.speculative_algorithm} if args.speculative_algorithm else {}
    if args.cuda_graph_max_bs:
        extra["cuda_graph_max_bs_decode"] = args.cuda_graph_max_bs
    if args.max_total_tokens:
        extra["max_total_tokens"] = args.max_total_tokens
    if args.chunked_prefill_size:
        extra["chunked_prefill_size"] = args.chunked_prefill_size
    engine = sglang.Engine(
        model_path=args.ckpt, skip_tokenizer_init=True, tp_size=args.tp,
        moe_runner_backend=args.moe_runner_backend, disable_cuda_graph=not args.cuda_graph,
        mem_fraction_static=args.mem_fraction, random_seed=0, log_level="warning",
        watchdog_timeout=args.watchdog_timeout, **extra,
    )
    record["timings"]["engine_start_s"] = round(time.time() - t0, 1)
    greedy = {"temperature": 0.0, "max_new_tokens": args.max_new}
    # SGLang 0.5.16 answers return_logprob under DSPARK (its DFLASH worker) with an abort ("does not support
    # return_logprob yet"): speculative runs record tokens and acceptance only, and no teacher-forced pass.
    lp_kw = {} if args.speculative_algorithm else {"return_logprob": True, "top_logprobs_num": 5}
    try:
        t0 = time.time()
        batched = engine.generate(input_ids=prompts, sampling_params=greedy, **lp_kw)
        record["timings"]["first_batch_s"] = round(time.time() - t0, 1)
        alone = [engine.generate(input_ids=p, sampling_params=greedy, **lp_kw) for p in prompts]
        if args.teacher_from:
            seqs = teacher_sequences(args.teacher_from)
        else:
            long_greedy = dict(greedy, max_new_tokens=args.teacher_new)
            cont = engine.generate(input_ids=prompts, sampling_params=long_greedy)
            seqs = [p + c["output_ids"] for p, c in zip(prompts, cont)]
        tf = []
        if not args.speculative_algorithm:
            t0 = time.time()
            tf_params = {"temperature": 0.0, "max_new_tokens": 1}
            tf_kw = dict(return_logprob=True, top_logprobs_num=args.top)
            starts = [0] * len(seqs)
            if args.prefix_hit:
                halves = [q[: len(q) // 2] for q in seqs]
                engine.generate(input_ids=halves, sampling_params=tf_params)
                starts = [len(h) for h in halves]
            ids = logprob_ids(args.token_ids_logprob, vocab, len(seqs))
            if args.teacher_mode == "batched":
                tf = engine.generate(input_ids=seqs, sampling_params=tf_params, logprob_start_len=starts, **tf_kw,
                                     **_ids_kw(ids))
            elif args.teacher_mode == "reversed":
                tf = engine.generate(input_ids=seqs[::-1], sampling_params=tf_params, logprob_start_len=starts[::-1],
                                     **tf_kw, **_ids_kw(ids and ids[::-1]))[::-1]
            else:
                tf = [engine.generate(input_ids=q, sampling_params=tf_params, logprob_start_len=starts[i], **tf_kw,
                                      **_ids_kw(ids and ids[i])) for i, q in enumerate(seqs)]
            record["timings"]["teacher_forced_s"] = round(time.time() - t0, 1)
    finally:
        engine.shutdown()

    def logprobs(r):
        return [e[0] for e in r["meta_info"].get("output_token_logprobs") or []]

    record["prompts"] = []
    for n, p, b, a in zip(lengths, prompts, batched, alone):
        lp = logprobs(b)
        record["prompts"].append({
            "length": n, "prompt": p,
            "batched": {"output_ids": b["output_ids"], "logprobs": lp,
                        "top5": [_pairs(x) for x in b["meta_info"].get("output_top_logprobs") or []]},
            "alone": {"output_ids": a["output_ids"], "logprobs": logprobs(a)},
            "finite": all(math.isfinite(x) for x in lp),
            "spec": spec_info(b["meta_info"]),
        })
    record["teacher"] = [teacher_entry(s, r["meta_info"], ids and ids[k]) for k, (s, r) in enumerate(zip(seqs, tf))]
    write_record(args.out, record)

    sm = "".join(map(str, record["capability"]))
    print(f"engine_bed: patch={'on' if patch else 'off'} gpu={record['gpu']} sm{sm} sglang {record['sglang']} "
          f"timings={record['timings']}")
    ok = True
    for pr in record["prompts"]:
        lp = pr["batched"]["logprobs"]
        agree = sum(x == y for x, y in zip(pr["batched"]["output_ids"], pr["alone"]["output_ids"]))
        ok &= pr["finite"] and len(pr["batched"]["output_ids"]) == args.max_new
        spec = f"  spec {pr['spec']}" if pr["spec"] else ""
        mean = f"mean logprob {sum(lp) / len(lp):.3f}" if lp else "no logprobs (speculative)"
        print(f"  prompt {pr['length']:5d} ids -> {pr['batched']['output_ids']}  finite={pr['finite']} "
              f"{mean}  batched-vs-alone agree {agree}/{len(pr['batched']['output_ids'])}{spec}")
    for t in record["teacher"]:
        top1 = [row[0][1] for row in t["top"] if row]
        finite = all(math.isfinite(x) for x in top1)
        distinct = len({row[0][0] for row in t["top"] if row})
        ok &= finite and distinct > 1
        print(f"  teacher-forced {len(t['sequence']):5d} positions: top-1 logprob mean {sum(top1) / len(top1):.3f} "
              f"min {min(top1):.3f}, {distinct} distinct top-1 ids, finite={finite}")
    report = env.get(env.LOAD_REPORT)
    if report and os.path.isfile(report):  # written by the patch's after-load check, one line per model
        for line in open(report):
            rep = json.loads(line)
            kinds = {}
            for r in rep["linears"]:
                key = f"{r['method']}/{r['dtype']}"
                kinds[key] = kinds.get(key, 0) + 1
            print(f"  load report {rep['model']} rank {rep['rank']}: {kinds}")
            print(f"    {rep['summary']}")
    print("engine_bed:", "OK" if ok else "FAILED", "->", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
