"""A PROJECTION, not a measurement: decode tokens/s of DeepSeek-V4-Flash at TP4 on 4 x A800 80 GB SXM, on paper.

Per decode forward of T tokens, one TP4 rank runs 43 layers of kernels whose times were measured on an H200 with
the SM80 path at TP4 per-rank shapes (`mma.sync` only where it matters; FIGURES below: value, date, command). Rule
"fraction" carries each time to the A800 by keeping its measured fraction of the device copy peak of its own run,
applied to the A800's published HBM rate (A800 below); rule "clock" moves the bytes at the A800's copy rate and
scales the rest by the SM clock ratio. A GEMM that turns compute-bound takes at least its FLOPs at an assumed
fraction of the A800's BF16 peak. Then: two all-reduces per layer plus the embedding's and the logits' collectives,
over NVLink or PCIe, and a host overhead per forward. DSPARK: one iteration is a 6-token verify per request, a
5-token draft block through the 3 DSPARK stages, and 5 Markov-head steps; it yields tau accepted tokens per
request. Every input that is not a measurement is in ASSUMPTIONS.

    python bench/a800_projection.py [--out docs/results/performance.json]

prints the per-stage table (us per decode step on one rank) and the tokens/s, and writes the JSON record. Re-run it
with A800 figures (replace FIGURES' H200 rows with A800 ones and set their copy peak) when they exist.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYERS, C4_LAYERS, C128_LAYERS, SWA_LAYERS = 43, 21, 20, 2  # compress_ratios of the release
DSPARK_STAGES, DSPARK_GAMMA = 3, 5  # dspark_target_layer_ids, dspark_block_size: verify gamma + 1 tokens
HIDDEN = 4096

A800 = {  # published: NVIDIA A800 80 GB SXM
    "hbm_gbps": 2039.0, "bf16_tflops": 312.0, "int8_tops": 624.0, "sms": 108, "clock_ghz": 1.41,
    "nvlink_gbps": 400.0,  # bidirectional, per GPU
}
H200_CLOCK_GHZ = 1.98  # H200 SXM boost clock: the ratio for fixed costs under the "clock" rule

ASSUMPTIONS = {
    "copy_efficiency": (0.88, "an A800's device copy reaches 0.88 of its published 2,039 GB/s (the H200's dense "
                              "bench measured 4,252 of 4,800 GB/s, 0.886)"),
    "gemm_efficiency": (0.45, "a BF16 GEMM of 100-400 tokens reaches 45 % of the A800's 312 TFLOP/s (cuBLAS on "
                              "the H200: 40 % / 58 % of its peak for wqkv_a / wq_b at 256 tokens, dense.md)"),
    "context": (4096, "tokens of context per request: C128 lists of 160 entries, the indexer's 1,024 C4 keys"),
    "small_kernels_per_layer": (14, "kernels per layer not in FIGURES: q/kv norms and RoPE, the KV and compressor "
                                    "state stores, router top-k and weights, the shared + routed sum, two mHC "
                                    "pre-mix and two post-mix kernels (TileLang)"),
    "small_kernel_us": (3.0, "H200 us each (in a CUDA graph: the empty kernel is 1.1 us; the measured one-query "
                             "attention floor is 5.4 us in two launches)"),
    "topk_us": (5.0, "H200 us of SGLang's top-k v1 per C4 layer (not timed alone)"),
    "sampler_us": (30.0, "H200 us per forward: final mHC head, norm, sampling, embedding gather"),
    "host_us": (50.0, "A800 us per forward not hidden by CUDA graphs and SGLang's overlap scheduler"),
    "allreduce_nvlink_us": (8.0, "latency of one small all-reduce over NVLink among 4 GPUs (one-shot custom "
                                 "all-reduce / NCCL LL), plus bytes at half the 400 GB/s link"),
    "allreduce_pcie_us": (20.0, "latency of one small all-reduce over PCIe Gen4 x16, plus bytes at 25 GB/s"),
    "pcie_gbps": (25.0, "achievable PCIe Gen4 x16 bandwidth per direction"),
    "tau": ((2.0, 2.5), "DSPARK accepted tokens per iteration (of 6): no acceptance has been measured on this path "
                        "(the generated checkpoints' drafts are random); 2.52 was published for TP4 A100"),
}


def A(key):
    """An assumption's value."""
    return ASSUMPTIONS[key][0]


# --- measured figures (H200, SM80 path, TP4 per-rank shapes) ------------------------------------------------
# us per call by token count (rows); copy: the device-copy peak (read + write GB/s) measured in the same run
FIGURES = {
    "moe": {"us": {1: 16.7, 2: 28.5, 4: 39.3, 8: 68.1, 16: 111.9, 32: 195.8, 64: 317.2, 512: 457.1, 2048: 800.3},
            "copy": 2667.0, "when": "2026-12-04", "cmd": "DISABLE_MMA_V3=1 python bench/moe.py --out moe.json",
            "note": "W4A8 routed experts, 256 x [512 x 4096], top-6, CUDA-graph replays over 20 routings"},
    "attn_c4": {"us": {1: 9.25, 8: 11.4, 64: 24.9}, "copy": 2762.0, "when": "2026-12-02",
                "cmd": "python bench/attention.py --prefill 8192 --out attention.json",
                "note": "sparse attention, 16 heads, 640 keys per query (copy: the 2026-12-04 run's)"},
    "attn_c128": {"us": {1: 11.1, 8: 11.3, 64: 12.3}, "copy": 2762.0, "when": "2026-12-02",
                  "cmd": "python bench/attention.py --prefill 8192 --out attention.json",
                  "note": "C128 layer at 4K context, 160 keys; also stands for the 2 SWA-only layers (128 keys)"},
    "indexer_q": {"us": {1: 7.7, 16: 8.3}, "copy": 2758.0, "when": "2026-12-01",
                  "cmd": "python bench/indexer.py --out indexer.json", "note": "RoPE, Hadamard, INT8 query"},
    "indexer_store": {"us": {16: 4.7}, "copy": 2758.0, "when": "2026-12-01",
                      "cmd": "python bench/indexer.py --out indexer.json", "note": "compress-store"},
    "indexer_logits": {"us": {16: 8.3}, "copy": 2758.0, "when": "2026-12-01",
                       "cmd": "python bench/indexer.py --out indexer.json", "note": "paged INT8 logits, 4K context"},
    "mhc_gemm": {"us": {1: 3.4, 16: 3.8, 64: 6.0}, "copy": 2773.0, "when": "2026-12-01",
                 "cmd": "python bench/mhc.py --variants --out mhc.json",
                 "note": "pre-norm GEMM; 64 rows: 1.79x DeepGEMM's ~3.3 us"},
    "dense": {"us": {"wqkv_a": 7.6, "wq_b": 6.8, "wo_b": 7.2, "shared_gate_up": 7.7, "shared_down": 4.1},
              "copy": 4252.0, "when": "2026-11-30",
              "cmd": "ENABLE_SGLANG_DSV4_A100_PATCH=0 python bench/dense_linear.py --out dense_linear.json",
              "note": "bf16 (cuBLAS) at 1 token; the bench's 1-16 tokens sit at that floor"},
}

BENCHED = {"wqkv_a": (1536, 4096), "wq_b": (8192, 1024), "wo_b": (4096, 2048), "shared_gate_up": (1024, 4096),
           "shared_down": (4096, 512)}  # bench/dense_linear.py's shapes (N, K)
# per-rank BF16 linears of one layer: (name, N, K, the benched shape whose 1-token time stands for it)
DENSE_ALL = [("wqkv_a", 1536, 4096, "wqkv_a"), ("wq_b", 8192, 1024, "wq_b"), ("wo_a", 2048, 4096, "wo_b"),
             ("wo_b", 4096, 2048, "wo_b"), ("shared gate_up", 1024, 4096, "shared_gate_up"),
             ("shared down", 4096, 512, "shared_down"), ("router", 256, 4096, "shared_down")]
DENSE_C4 = [("compressor wkv_gate", 2048, 4096, "wo_b"), ("indexer wq_b", 8192, 1024, "wq_b"),
            ("indexer weights_proj", 64, 4096, "shared_down"), ("indexer compressor", 512, 4096, "shared_down")]
DENSE_C128 = [("compressor wkv_gate", 1024, 4096, "shared_gate_up")]
HEAD = (32320, 4096)  # the vocab-parallel LM head's share
MAIN_PROJ = (4096, 3 * 4096)  # DSPARK, replicated
MARKOV_W2 = (32320, 256)  # SGLang shards it by vocab (SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD=1)


def interp(points: dict, x: float) -> float:
    """Linear in x between measured points; beyond the last two, their slope (never below the last value)."""
    xs = sorted(points)
    if x <= xs[0] or len(xs) == 1:
        return points[xs[0]]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[x]
    lo, hi = (xs[i - 1], xs[i]) if i < len(xs) else (xs[-2], xs[-1])
    y = points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return max(y, points[xs[-1]]) if i == len(xs) else y


def copy_a800() -> float:
    return A800["hbm_gbps"] * A("copy_efficiency")


def carry(h200_us: float, nbytes: float, copy_h200: float, rule: str, flops: float = 0.0,
          a800_peak: float = 0.0) -> float:
    """A800 us of a kernel the H200 ran in h200_us. rule "fraction": the same fraction of the copy peak (every
    cost scales like bandwidth); "clock": the bytes at the A800's copy peak plus the H200's excess over its own
    bytes time scaled by the SM clock ratio. A compute-bound kernel takes at least flops / a800_peak (ops/s)."""
    if rule == "fraction":
        t = h200_us * copy_h200 / copy_a800()
    else:
        excess = max(h200_us - nbytes / copy_h200 / 1e3, 0.0)
        t = excess * H200_CLOCK_GHZ / A800["clock_ghz"] + nbytes / copy_a800() / 1e3
    return max(t, flops / a800_peak * 1e6) if a800_peak else t


def dense_us(linears, tokens: int, rule: str) -> float:
    f = FIGURES["dense"]
    total = 0.0
    for _, n, k, stand_in in linears:
        nbytes = 2.0 * n * k
        sn, sk = BENCHED[stand_in]  # a linear larger than its stand-in: the stand-in's time per byte
        h200 = f["us"][stand_in] * max(nbytes / (2.0 * sn * sk), 1.0)
        total += carry(h200, nbytes, f["copy"], rule, flops=2.0 * tokens * n * k,
                       a800_peak=A800["bf16_tflops"] * 1e12 * A("gemm_efficiency"))
    return total


def fig(name: str, rows: float, rule: str, nbytes: float = 0.0, times: int = 1) -> float:
    f = FIGURES[name]
    return times * carry(interp(f["us"], rows), nbytes, f["copy"], rule)


def allreduce_us(tokens: int, link: str) -> float:
    nbytes = tokens * HIDDEN * 2
    if link == "nvlink":
        return A("allreduce_nvlink_us") + 2 * 0.75 * nbytes / (A800["nvlink_gbps"] / 2 * 1e3)
    return A("allreduce_pcie_us") + 2 * 0.75 * nbytes / (A("pcie_gbps") * 1e3)


def moe_bytes(tokens: int) -> float:
    touched = 256 * (1 - (1 - 6 / 256) ** tokens)
    return touched * 3 * 512 * 4096 * (0.5 + 1 / 32)


def forward_stages(tokens: int, rule: str, link: str, layers: dict | None = None) -> dict:
    """{stage: A800 us} of one forward of `tokens` tokens (all requests' rows) on one rank. layers: how many of
    each kind ({"c4", "c128", "swa"}); default the release's 43."""
    kinds = layers or {"c4": C4_LAYERS, "c128": C128_LAYERS, "swa": SWA_LAYERS}
    n = sum(kinds.values())
    ctx_keys = A("context") // 4
    logits_bytes = tokens * ctx_keys * 132.0
    s = {
        "dense linears": n * dense_us(DENSE_ALL, tokens, rule) + kinds["c4"] * dense_us(DENSE_C4, tokens, rule)
        + kinds["c128"] * dense_us(DENSE_C128, tokens, rule),
        "routed experts": n * fig("moe", tokens, rule, moe_bytes(tokens)),
        "attention": kinds["c4"] * fig("attn_c4", tokens, rule, tokens * 640 * 1024.0)
        + (kinds["c128"] + kinds["swa"]) * fig("attn_c128", tokens, rule, tokens * 160 * 1024.0),
        "indexer": kinds["c4"] * (fig("indexer_q", tokens, rule) + fig("indexer_store", tokens, rule)
                                  + max(fig("indexer_logits", tokens, rule), logits_bytes / copy_a800() / 1e3 / 0.59)
                                  + carry(A("topk_us"), 0.0, FIGURES["indexer_q"]["copy"], rule)),
        "mHC GEMM": n * fig("mhc_gemm", tokens, rule, times=2),
        "small kernels": n * A("small_kernels_per_layer") * carry(A("small_kernel_us"), 0.0, 2773.0, rule),
        "LM head + sampler": dense_us([("head", HEAD[0], HEAD[1], "wq_b")], tokens, rule)
        + carry(A("sampler_us"), 0.0, 2773.0, rule),
        "all-reduce": (2 * n + 2) * allreduce_us(tokens, link),
        "host": A("host_us"),
    }
    return s


def plain_tok_s(batch: int, rule: str, link: str) -> tuple[float, dict]:
    s = forward_stages(batch, rule, link)
    return batch / (sum(s.values()) * 1e-6), s


def dspark_iteration(batch: int, rule: str, link: str) -> dict:
    """{part: A800 us} of one DSPARK iteration for `batch` requests."""
    verify = forward_stages(batch * (DSPARK_GAMMA + 1), rule, link)
    draft = forward_stages(batch * DSPARK_GAMMA, rule, link, layers={"c4": 0, "c128": 0, "swa": DSPARK_STAGES})
    draft.pop("host")
    # the verified tokens' target hidden states: main_proj, then each stage's wkv for the draft's KV injection
    extra = dense_us([("main_proj", MAIN_PROJ[0], MAIN_PROJ[1], "wo_b")]
                     + [("draft wkv", 512, HIDDEN, "shared_down")] * DSPARK_STAGES, batch * (DSPARK_GAMMA + 1), rule)
    markov = DSPARK_GAMMA * (dense_us([("markov_w2", MARKOV_W2[0], MARKOV_W2[1], "shared_down")], batch, rule)
                             + carry(A("small_kernel_us") * 2, 0.0, 2773.0, rule))
    return {"verify": sum(verify.values()), "draft": sum(draft.values()) + extra, "markov": markov}


def dspark_tok_s(batch: int, tau: float, rule: str, link: str) -> float:
    return tau * batch / (sum(dspark_iteration(batch, rule, link).values()) * 1e-6)


ANCHORS = {
    "published, 8 x A100 TP8, SGLang with an SM80 overlay, no speculation, batch 1": 71.9,
    "published, 4 x A100 SXM TP4, SGLang 0.5.16 port, DSPARK (accept length 2.52), concurrency 1": 107.0,
    "published, 8 x A100 TP8, vLLM, DSPARK k6, one request": 209.6,
    "published, 4 x H200, native SGLang, DSPARK, one stream (TPOT 1.72 ms)": 1000 / 1.72,
}
GOALS = {"plain": 75.0, "dspark": 110.0}
BATCHES = (1, 16, 64)


def project() -> dict:
    out = {"note": "PROJECTION on paper from H200 kernel figures scaled to A800 peaks; not a measurement",
           "assumptions": {k: {"value": v[0], "why": v[1]} for k, v in ASSUMPTIONS.items()},
           "a800": A800, "figures": FIGURES, "rules": {}}
    for rule in ("fraction", "clock"):
        for link in ("nvlink", "pcie"):
            rows = {}
            for b in BATCHES:
                plain, stages = plain_tok_s(b, rule, link)
                rows[str(b)] = {"plain": round(plain, 1),
                                **{f"dspark_tau{t}": round(dspark_tok_s(b, t, rule, link), 1) for t in A("tau")},
                                "step_us": {k: round(v, 1) for k, v in stages.items()},
                                "dspark_iteration_us": {k: round(v, 1) for k, v in
                                                        dspark_iteration(b, rule, link).items()}}
            out["rules"][f"{rule}/{link}"] = rows
    head = out["rules"]["fraction/nvlink"]
    out["a800_projection"] = {b: {"without_dspark": head[b]["plain"],
                                  "with_dspark": {f"tau {t}": head[b][f"dspark_tau{t}"] for t in A("tau")}}
                              for b in head}
    out["a800_projection_basis"] = ("rule 'fraction' (every kernel keeps its measured fraction of the H200 peak "
                                    "that bounds it), NVLink; rules.clock/* is the optimistic reading, rules.*/pcie "
                                    "the PCIe-only host")
    out["anchors_tok_s"] = {k: round(v, 1) for k, v in ANCHORS.items()}
    out["goals_batch1"] = {"without_dspark": GOALS["plain"], "with_dspark": GOALS["dspark"]}
    out["h200_full_depth"] = None
    out["ttft_ms"] = None
    out["not_yet_measured"] = ("h200_full_depth and ttft_ms: not yet measured (bench/e2e.py --preset full on an "
                               "H200; TTFT at TP4 on the A800s)")
    return out


def report(rec: dict) -> list:
    lines = ["A800 x 4, TP4: PROJECTION from H200 figures (not a measurement)", ""]
    rows = rec["rules"]["fraction/nvlink"]
    stages = list(rows["1"]["step_us"])
    lines.append(f"{'us per decode step, one rank':32s}" + "".join(f"{'batch ' + b:>12s}" for b in rows))
    for st in stages:
        lines.append(f"{st:32s}" + "".join(f"{rows[b]['step_us'][st]:12.1f}" for b in rows))
    lines.append(f"{'total':32s}" + "".join(f"{sum(rows[b]['step_us'].values()):12.1f}" for b in rows))
    lines.append("")
    lines.append(f"{'tok/s (rule/link)':22s}" + "".join(f"{'b' + b + ' plain':>12s}{'b' + b + ' DSPARK':>18s}"
                                                         for b in rows))
    for key, r in rec["rules"].items():
        cells = "".join(f"{r[b]['plain']:12.1f}{r[b]['dspark_tau2.0']:>8.1f}-{r[b]['dspark_tau2.5']:<9.1f}"
                        for b in r)
        lines.append(f"{key:22s}{cells}")
    lines.append("(DSPARK at tau 2.0-2.5 accepted tokens per iteration)")
    for k, v in rec["anchors_tok_s"].items():
        lines.append(f"anchor: {v:7.1f} tok/s  {k}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the JSON record here (docs/results/performance.json)")
    args = ap.parse_args(argv)
    rec = project()
    print("\n".join(report(rec)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
