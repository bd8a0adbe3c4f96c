"""SGLang 0.5.16's own DSV4 attention test kit (sglang/test/kits/attention_unittest/attention_methods/
dsv4_attention.py) run against the patched backend and the BF16 pool, on a GPU.

    ENABLE_SGLANG_DSV4_A100_PATCH=1 DSV4_SM80_LAB=1 DSV4_SM80_TRIPWIRE=1 python -m dsv4_lab.beds.attention_kit

The kit ships no driver in the wheel; this is one. Two adaptations, both to the kit's FP8 assumptions,
none to SGLang: the kit builds its pool with dtype=float8_e4m3fn (the SM80 datapath keeps DSV4's KV in
BF16, so the pool is built BF16), and it packs K to FP8 with a Triton float8e4nv kernel before writing
(on the BF16 pool the rows go in as they are). Its references are pure-torch fp32 softmax over the BF16 K,
its tolerance 8e-2 (written for FP8); the BF16 path is also held to --tol (default 2e-2).

Cases: the kit's own (SWA-only extend and decode, window and page boundaries, sink on/off) for the SWA
entry point, plus each case with compress ratio 4 and 128 through the compress entry point (the C4 and C128
cases the kit lacks), target-verify for ratios 0/4/128 on decode cases, and draft-extend (ratio 0).

CUDA graphs: the kit's own decode graph runner on each decode case (the backend's capture-time and
replay-time metadata path, replay padded to the capture batch, against eager and the reference), and a
real `torch.cuda.CUDAGraph` of the SM80 kernel captured once and replayed while every request's lists grow
(SWA window filling, C4 top-k and C128 entries appearing), bit-equal to an eager call at every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
import unittest

DRAFT_TOKENS = 4  # MTP with 3 speculative steps: 4 tokens verified per request
ACCEPTED = 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch

    from dsv4_sm80 import env

    if not env.patch_enabled():
        print("attention_kit: ENABLE_SGLANG_DSV4_A100_PATCH=1 is required (it is what is being tested)")
        return 2
    import sglang.test.kits.attention_unittest.attention_methods.dsv4_attention as K
    from sglang.srt.mem_cache import deepseek_v4_memory_pool as P
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    original_init = P.DeepSeekV4TokenToKVPool.__init__

    def bf16_pool(self, *a, **kw):
        if kw.get("dtype") == torch.float8_e4m3fn:
            kw["dtype"] = torch.bfloat16
        return original_init(self, *a, **kw)

    P.DeepSeekV4TokenToKVPool.__init__ = bf16_pool
    K.quant_to_nope_fp8_rope_bf16_pack_triton = lambda k: k.to(torch.bfloat16).contiguous()
    K.DSV4_ATOL = K.DSV4_RTOL = args.tol

    tc = unittest.TestCase()
    cases = list(K.make_dsv4_cases("dsv4"))
    runs = []
    for case in cases:
        runs.append(("swa", case.name, lambda c=case: K.run_dsv4_attention_case(tc, c)))
        for ratio in (4, 128):
            c = dataclasses.replace(case, compress_ratio=ratio, name=f"{case.name}-c{ratio}")
            runs.append((f"compress-c{ratio}", c.name,
                         lambda c=c: K.run_dsv4_compress_attention_case(tc, c, sparse_prefill=False)))
        if case.forward_mode.is_decode():
            # The decode cases' prefixes, re-cast as the speculative modes the runners require: a chain of
            # DRAFT_TOKENS tokens verified per request (TARGET_VERIFY), and ACCEPTED tokens re-extended
            # by the draft model (DRAFT_EXTEND_V2, SWA only as in production).
            bs = len(case.prefix_lens)
            for ratio in (0, 4, 128):
                c = dataclasses.replace(case, forward_mode=ForwardMode.TARGET_VERIFY, compress_ratio=ratio,
                                        extend_lens=(DRAFT_TOKENS,) * bs, name=f"{case.name}-verify-c{ratio}")
                runs.append((f"verify-c{ratio}", c.name, lambda c=c: K.run_dsv4_target_verify_attention_case(tc, c)))
            c = dataclasses.replace(case, forward_mode=ForwardMode.DRAFT_EXTEND_V2, compress_ratio=0,
                                    extend_lens=(ACCEPTED,) * bs, name=f"{case.name}-draft-extend")
            runs.append(("draft-extend", c.name, lambda c=c: K.run_dsv4_draft_extend_attention_case(tc, c)))

    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as G

    G.DSV4_ATOL = G.DSV4_RTOL = args.tol
    for case in cases:
        if case.forward_mode.is_decode():
            runs.append(("graph-decode", case.name, lambda c=case: G.run_dsv4_cuda_graph_decode_case(
                tc, c, cuda_graph_capture_batch_size=max(2, len(c.prefix_lens)))))
    for ratio in (4, 128):
        runs.append(("graph-replay", f"growing-c{ratio}", lambda r=ratio: graph_replay_growing(r)))

    results = []
    for kind, name, fn in runs:
        try:
            fn()
            results.append({"kind": kind, "case": name, "ok": True})
        except Exception as e:  # one line per failing case, the full trace in the JSON
            results.append({"kind": kind, "case": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:600],
                            "trace": traceback.format_exc()[-3000:]})
    by_kind = {}
    for r in results:
        ok, n = by_kind.get(r["kind"], (0, 0))
        by_kind[r["kind"]] = (ok + r["ok"], n + 1)
    print(f"attention_kit: {torch.cuda.get_device_name(0)}, patched backend + BF16 pool, tolerance {args.tol}")
    for kind, (ok, n) in by_kind.items():
        print(f"  {kind:14s} {ok}/{n} passed")
    for r in results:
        if not r["ok"]:
            print(f"  FAIL {r['kind']} {r['case']}: {r['error'].splitlines()[0]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    failed = sum(not r["ok"] for r in results)
    print("attention_kit:", "OK" if not failed else f"{failed} FAILED")
    return 0 if not failed else 1


def graph_replay_growing(ratio: int, batch: int = 4, steps: int = 40) -> None:
    """Capture the SM80 sparse-attention kernel once in a CUDA graph with short lists, then grow every
    request's lists in place (SWA up to the 128 window; C4: top-k entries up to 512; C128: one entry per
    128 tokens) and replay: each replay must equal an eager call on the same buffers bit for bit."""
    import torch

    from dsv4_sm80.kernels.sparse_attn import sparse_attn

    torch.manual_seed(ratio)
    dev, heads, hpad, width_e = "cuda", 16, 64, 512 if ratio == 4 else 256
    slots = 8192
    swa = torch.randn(slots, 512, device=dev).to(torch.bfloat16)
    ext = torch.randn(slots, 512, device=dev).to(torch.bfloat16)
    q = torch.randn(batch, hpad, 512, device=dev).to(torch.bfloat16)
    sink = torch.randn(hpad, device=dev)
    swa_ids = torch.full((batch, 128), -1, dtype=torch.int32, device=dev)
    ext_ids = torch.full((batch, width_e), -1, dtype=torch.int32, device=dev)
    swa_lens = torch.ones(batch, dtype=torch.int32, device=dev)
    ext_lens = torch.zeros(batch, dtype=torch.int32, device=dev)

    def call():
        return sparse_attn(q, swa, swa_ids, swa_lens, ext, ext_ids, ext_lens, sink, heads=heads, splits=None)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(steps):
        seq = 1 + step * 37  # tokens so far per request, growing past the window and the top-k width
        for b in range(batch):
            n_swa = min(seq, 128)
            swa_ids[b, :n_swa] = torch.randint(0, slots, (n_swa,), device=dev, dtype=torch.int32)
            n_ext = min(seq // ratio, width_e)
            ext_ids[b, :n_ext] = torch.randint(0, slots, (n_ext,), device=dev, dtype=torch.int32)
            if n_ext > 2:
                ext_ids[b, 1] = -1  # a hole, as padding and DSPARK write
            swa_lens[b], ext_lens[b] = n_swa, n_ext
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = call()
        torch.cuda.synchronize()
        if not torch.equal(out[:, :heads], want[:, :heads]):
            diff = (out[:, :heads].float() - want[:, :heads].float()).abs().max().item()
            raise AssertionError(f"replay differs from eager at step {step} (seq {seq}): max |diff| {diff}")


if __name__ == "__main__":
    sys.exit(main())
