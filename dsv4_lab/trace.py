"""Lab: every module's inputs and outputs in one forward, recorded through SGLang's own forward hooks, to find
where the SM80 path and native part ways.

Why: with native's FP8 roundings replayed (rounding kv,act,idx) the patched path still agrees with native
on only 95-98 % of confident positions against native's 99 % with itself (docs/results/README.md, 2026-11-30
and 2026-12-01), and the end-to-end logprobs cannot say which module adds the difference. Two traces of the same
prompt (native, patched) compared module by module can: a module whose output differs much more than its input is
where the
arithmetic differs.

How: SGLang 0.5.16 registers `ServerArgs.forward_hooks` specs on the matching modules after CUDA-graph capture
(model_executor/hook_manager.py:11-55, called from model_runner_components/cuda_graph_setup.py:118-121), so hooks
fire on eager forwards only, in the scheduler process, on every TP rank. `trace_spec` is such a spec; the hook
keeps, for the first forward whose `embed_tokens` receives `rows` token ids (a prefill of that prompt), every
floating tensor with `rows` leading rows in each module's inputs and outputs, copied to the CPU in call order,
and saves them when the model's `norm` returns: `forward-0-rank0.pt` (see `factory` for why it works that way).
It reports on stderr (`lab_trace[rank N]: armed / recording / saved`), so a log says where a trace stopped.

    engine = sglang.Engine(..., forward_hooks=trace_spec(out_dir, rows=len(prompt)), disable_cuda_graph=True)
    python -m dsv4_lab.trace native_dir patched_dir [--floor other_native_dir]

Lab only: never a default, never for serving (a device-to-host copy per module and forward).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

FACTORY = "dsv4_lab.trace:factory"
TARGETS = ("model.*",)  # fnmatch: every module under the model (lm_head and the logits processor aside)


def _switches() -> str:
    """The module-level choices of deepseek_v4.py that decide where native rounds, as this process took them
    (e.g. `_FP8_WO_A_GEMM`, read at import: wo_a as an FP8 DeepGEMM einsum or a BF16 one): a trace says which
    arithmetic it recorded."""
    mod = sys.modules.get("sglang.srt.models.deepseek_v4")
    names = ("_FP8_WO_A_GEMM",)
    return ", ".join(f"{n}={getattr(mod, n, '?')}" for n in names) if mod else "deepseek_v4 not imported"


def trace_spec(out_dir: str, rows: int, forwards: int = 1, targets=TARGETS, params: bool = False) -> list:
    """The `forward_hooks` server argument that records the first `forwards` forwards of `rows` tokens; with
    `params`, each module's 2-D `weight` and its block scale (`weight_scale_inv` / `weight_scale`) too, as the
    running kernels hold them (for `linear_check`)."""
    if rows < 2:
        raise ValueError(f"rows={rows}: a traced forward needs at least 2 tokens (decode steps of one request "
                         "have 1 and would be recorded too)")
    return [{"name": "dsv4-sm80-trace", "target_modules": list(targets), "hook_factory": FACTORY,
             "config": {"dir": out_dir, "rows": int(rows), "forwards": int(forwards), "params": bool(params)}}]


def _tensors(obj, rows: int, depth: int = 0) -> list:
    """The floating tensors with `rows` leading rows in obj (a tensor, or tuples / lists of them, two levels)."""
    import torch

    if torch.is_tensor(obj):
        if obj.is_floating_point() and obj.dim() >= 1 and obj.shape[0] == rows:
            return [obj.detach().to("cpu", copy=True)]
        return []
    if isinstance(obj, (tuple, list)) and depth < 2:
        return [t for x in obj for t in _tensors(x, rows, depth + 1)]
    return []


def _params(module) -> dict:
    """A module's own 2-D floating `weight` and its scale tensor (`weight_scale_inv`, else `weight_scale`), on the
    CPU, as the module holds them now (after SGLang's and our load-time processing); {} without such a weight."""
    import torch

    w = getattr(module, "weight", None)
    if not (torch.is_tensor(w) and w.dim() == 2 and w.is_floating_point()):  # FP8 included
        return {}
    out = {"weight": w.detach().to("cpu", copy=True)}
    for attr in ("weight_scale_inv", "weight_scale"):
        s = getattr(module, attr, None)
        if torch.is_tensor(s):
            out["scale"] = s.detach().to("cpu", copy=True)
            break
    b = getattr(module, "bias", None)
    if torch.is_tensor(b):
        out["bias"] = b.detach().to("cpu", copy=True)
    return out


def _rank() -> int:
    import torch

    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _registering_model():
    """The model SGLang is attaching hooks to: `register_forward_hooks(model, hook_specs)` (hook_manager.py:11)
    calls the factory, so the factory's caller's frame holds it as `model`. Lab only; None if the caller is
    not that function (then `factory` falls back to one scan of the garbage collector's objects)."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "register_forward_hooks" and "model" in frame.f_locals:
            return frame.f_locals["model"]
    return None


def _is_dsv4_model(m) -> bool:
    """DeepseekV4Model: the module with `layers` and `embed_tokens`."""
    return hasattr(m, "layers") and hasattr(m, "embed_tokens")


def _dsv4_model(root):
    """The DSV4 model module under root (root included), and its qualified name."""
    for name, m in root.named_modules():
        if _is_dsv4_model(m):
            return name, m
    return None, None


def _scan_for_root(module):
    """Fallback: a live module with `layers` and `embed_tokens` that holds `module`, found by one scan of the
    garbage collector's objects (about 1 s on a loaded scheduler; never repeated)."""
    import gc

    from torch import nn

    for obj in gc.get_objects():
        mod = getattr(type(obj), "__module__", "")  # a descriptor, not a string, for some extension types
        if isinstance(mod, str) and mod.startswith("torch.distributed"):  # deprecated shims warn on isinstance
            continue
        if isinstance(obj, nn.Module) and _is_dsv4_model(obj):
            if any(m is module for m in obj.modules()):
                return obj
    return None


def _say(msg: str) -> None:
    print(f"lab_trace[rank {_rank()}]: {msg}", file=sys.stderr, flush=True)


def factory(config: dict):
    """SGLang's hook factory contract (hook_manager.py:31): config -> hook(module, inputs, output).

    SGLang registers only post-forward hooks, which see positional inputs; DSV4 calls its decoder layers and
    attention with keyword arguments, and its model module through `.forward` (no hooks of its own). So the
    factory takes the model SGLang is registering on from its caller (`_registering_model`), names every module
    under DeepseekV4Model and puts a pre-forward hook with keyword arguments on each: a forward is traced when
    `embed_tokens` receives `rows` token ids, each module's inputs are what its pre-hook saw, and the record is
    saved when `norm` (the model's last module) returns. Should the caller not hold the model, the first
    hook call finds it by one scan (that forward is not recorded); if that fails too, tracing is off and says
    so (no scan per module call: a trace that scanned per call hung)."""
    out_dir, rows = config["dir"], int(config["rows"])
    keep = int(config.get("forwards", 1))
    want_params = bool(config.get("params", False))
    state = {"pending": [], "saved": 0, "armed": False, "failed": False, "active": False, "stack": {},
             "names": {}, "mods": {}, "embed": None, "norm": None}

    def pre(module, args, kwargs):
        if module is state["embed"]:
            ids = args[0] if args else kwargs.get("input_ids", kwargs.get("input_"))
            state["active"] = hasattr(ids, "shape") and ids.shape[0] == rows and state["saved"] < keep
            state["pending"].clear()
            state["stack"].clear()
            if state["active"]:
                _say(f"recording a forward of {rows} rows")
        if state["active"]:
            state["stack"].setdefault(id(module), []).append(_tensors(list(args) + list(kwargs.values()), rows))

    def arm(root) -> bool:
        prefix, model = _dsv4_model(root)
        if model is None:
            return False
        prefix = prefix or "model"  # found by the scan it is the root itself; SGLang's top module names it model
        state["names"] = {id(m): f"{prefix}.{n}" if n else prefix for n, m in model.named_modules()}
        state["mods"] = {id(m): m for m in model.modules()}
        for _, m in model.named_modules():
            m.register_forward_pre_hook(pre, with_kwargs=True)
        state["embed"], state["norm"] = model.embed_tokens, getattr(model, "norm", None)
        state["armed"] = True
        _say(f"armed on {len(state['names'])} modules under {prefix}")
        _say(f"SGLang's precision switches in this process: {_switches()}")
        return True

    def save() -> None:
        import torch

        seen, records = {}, []
        for mid, ins, outs in state["pending"]:
            name = state["names"].get(mid, "<unnamed>")
            seen[name] = seen.get(name, 0) + 1
            rec = {"name": name if seen[name] == 1 else f"{name}#{seen[name]}", "in": ins, "out": outs}
            if want_params and seen[name] == 1 and mid in state["mods"]:
                rec["params"] = _params(state["mods"][mid])
            records.append(rec)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"forward-{state['saved']}-rank{_rank()}.pt")
        torch.save(records, path)
        _say(f"saved {len(records)} modules -> {path}")
        state["saved"] += 1
        state["pending"].clear()
        state["active"] = False

    root = _registering_model()
    if root is not None and not arm(root):
        _say(f"no module with layers and embed_tokens under {type(root).__name__}: nothing will be traced")
        state["failed"] = True

    def hook(module, inputs, output):
        if state["saved"] >= keep or state["failed"]:
            return
        if not state["armed"]:
            top = _scan_for_root(module)
            if top is None or not arm(top):
                _say("the model holding the hooked modules was not found: nothing will be traced")
                state["failed"] = True
            return
        if not state["active"]:
            return
        saved = state["stack"].get(id(module))
        ins = saved.pop() if saved else _tensors(inputs, rows)
        outs = _tensors(output, rows)
        if ins or outs:
            state["pending"].append((id(module), ins, outs))
        if module is state["norm"]:
            save()

    return hook


def rel(a, b) -> float:
    """||a - b|| / ||a|| in float64 (0 when both are zero; inf when only b is nonzero or shapes differ)."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.double(), b.double()
    na = float(a.norm())
    nd = float((a - b).norm())
    if na == 0.0:
        return 0.0 if nd == 0.0 else math.inf
    return nd / na


def compare(a: list, b: list, floor: list | None = None, jump: float = 3.0, min_rel: float = 1e-2) -> list:
    """Per module present in both traces (by name and call count), in a's call order: the relative difference of
    its first input and first output tensor (b against a), the floor's (floor against a) beside them, and
    `suspect` where the output differs at least `min_rel` and `jump` times more than the input does (the
    module itself adds the difference; modules without a traced input compare their output alone)."""
    bmap = {r["name"]: r for r in b}
    fmap = {r["name"]: r for r in floor or []}
    rows = []
    for r in a:
        o = bmap.get(r["name"])
        if o is None or not r["out"] or not o["out"]:
            continue
        d_out = rel(r["out"][0], o["out"][0])
        d_in = rel(r["in"][0], o["in"][0]) if r["in"] and o["in"] else None
        f = fmap.get(r["name"])
        f_out = rel(r["out"][0], f["out"][0]) if f and f["out"] else None
        suspect = d_out >= min_rel and (d_in is None or d_out >= jump * max(d_in, 1e-12))
        rows.append({"name": r["name"], "in": d_in, "out": d_out, "floor_out": f_out, "suspect": suspect})
    return rows


BLOCK = 128  # the checkpoint's FP8 weight blocks (128 x 128, one scale each)


def exact_weight(params: dict):
    """The float64 weight a recorded linear multiplies by: a float weight as it is; an FP8 one times its block
    scale ([ceil(N/128), ceil(K/128)], fp32 or E8M0), each scale over its 128 x 128 block. None when the scale's
    layout is not that (e.g. packed UE8M0 words for SM100's DeepGEMM)."""
    import torch

    w = params.get("weight")
    if w is None:
        return None
    if w.dtype != torch.float8_e4m3fn:
        return w.double()
    s = params.get("scale")
    n, k = w.shape
    if s is None or not s.is_floating_point():
        return None
    if s.dim() != 2 or s.shape != (-(-n // BLOCK), -(-k // BLOCK)):
        return None
    full = s.double().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return w.double() * full


def linear_check(records: list, max_rows: int = 4096, device: str = "cpu", models: dict | None = None) -> list:
    """Each recorded linear (a record with `params` from a `params=True` trace, its first input [.., K] and its
    output [.., N]) against models of its arithmetic on its own recorded input X, W its exact weight:
      exact    X @ W^T in float64;
      bf16     X @ W^T in fp32, rounded to BF16 once (the SM80 dense path: an exact BF16 weight);
      fp8 act  X through native's per-token, per-128 FP8 activation rounding (rounding.fp8_act), then as bf16
               (what native's DeepGEMM FP8 linear computes on SM90, if that reading of its sources is right).
    Relative differences (||a - b|| / ||a||): the output against each model, and each model against exact. On
    identical inputs, so input differences between two runs play no part. `device`: where the products run
    (float64 on a GPU is quick; the figures do not depend on it beyond fp32 summation order). `models`: more
    models, {name: fn(x [rows, K] on device, params, exact weight W) -> output [rows, N]}, each row's output
    against them in `out_vs_models` (a model that raises: its error text there), e.g. `sglang_models()`."""
    import torch

    from .rounding import ACT_GROUP, fp8_act

    rows = []
    for r in records:
        p = r.get("params") or {}
        w = exact_weight(p)
        if w is None or not r["in"] or not r["out"]:
            continue
        n, k = w.shape
        x, y = r["in"][0], r["out"][0]
        if x.shape[-1] != k or y.shape[-1] != n:
            continue
        x = x.reshape(-1, k)[:max_rows].to(device)
        y = y.reshape(-1, n)[:max_rows].double().to(device)
        w = w.to(device)
        b64 = p["bias"].double().to(device) if "bias" in p else 0.0
        b32 = p["bias"].float().to(device) if "bias" in p else 0.0
        exact = x.double() @ w.t() + b64
        wf = w.float()
        out_dtype = r["out"][0].dtype
        bf16 = (x.float() @ wf.t() + b32).to(out_dtype).double()
        act = None
        if k % ACT_GROUP == 0:
            act = (fp8_act(x) @ wf.t() + b32).to(out_dtype).double()
        extra = {}
        for name, fn in (models or {}).items():
            try:
                extra[name] = rel(fn(x, p, w).reshape(-1, n).double(), y)
            except Exception as e:  # a model this GPU or this trace cannot run: say why, keep the table
                extra[name] = f"{type(e).__name__}: {e}"[:160]
        rows.append({
            "name": r["name"], "k": k, "n": n, "fp8_weight": p["weight"].dtype == torch.float8_e4m3fn,
            "out_vs_exact": rel(exact, y), "out_vs_bf16": rel(bf16, y),
            "out_vs_act": None if act is None else rel(act, y),
            "bf16_vs_exact": rel(exact, bf16), "act_vs_exact": None if act is None else rel(exact, act),
            "out_vs_models": extra,
        })
    return rows


def sglang_models() -> dict:
    """`linear_check` models from native SGLang's own FP8 code (an SM90 GPU with SGLang 0.5.16; lab only), for
    FP8-weight linears: which part of native's FP8 linear the fp8-act model does not reproduce (on the
    H200, 2026-12-01: native's output is 2-3.5e-3 from that model on every FP8 linear, against 0 for the replay's own):
      sglang quant   SGLang's per-token-group activation quantizer (`sglang_per_token_group_quant_fp8`, group
                     128, the arguments deepgemm_w8a8_block_fp8_linear_with_fallback passes on SM90: fp32 scales),
                     dequantized, then the exact weight's fp32 product rounded once to BF16;
      sglang linear  the whole FP8 block linear native's Fp8LinearMethod dispatches to on SM90 with DeepGEMM
                     (`deepgemm_w8a8_block_fp8_linear_with_fallback`) on the recorded FP8 weight and scale.
    If `sglang quant` matches native, the quantizer is what the fp8-act model misses; if only `sglang linear`
    does, DeepGEMM's product (accumulation) is."""
    import torch
    from sglang.srt.layers.quantization.fp8_utils import deepgemm_w8a8_block_fp8_linear_with_fallback

    from .rounding import sglang_act

    def fp8_only(p):
        if p["weight"].dtype != torch.float8_e4m3fn:
            raise ValueError("a BF16 weight: native runs no FP8 linear here")

    def quant(x, p, w):
        fp8_only(p)
        return (sglang_act(x) @ w.float().t()).to(torch.bfloat16)

    def linear(x, p, w):
        fp8_only(p)
        return deepgemm_w8a8_block_fp8_linear_with_fallback(
            x.to(torch.bfloat16).contiguous(), p["weight"].to(x.device), [BLOCK, BLOCK],
            p["scale"].to(x.device), None, p["bias"].to(x.device) if "bias" in p else None)

    return {"sglang quant": quant, "sglang linear": linear}


def print_linears(path: str, rows: list) -> None:
    print(f"lab_trace: linears of {path}: {len(rows)} recorded linears against models of their arithmetic, on "
          "their own inputs (relative differences)")
    print(f"  {'module':50s} {'K':>5s} {'N':>5s} {'w':>4s} {'out-exact':>9s} {'out-bf16':>9s} {'out-fp8act':>10s}"
          f" {'bf16-exact':>10s} {'fp8act-exact':>12s}")
    for r in rows:
        print(f"  {r['name'][:50]:50s} {r['k']:5d} {r['n']:5d} {'fp8' if r['fp8_weight'] else 'bf16':>4s} "
              f"{_fmt(r['out_vs_exact']):>9s} {_fmt(r['out_vs_bf16']):>9s} {_fmt(r['out_vs_act']):>10s} "
              f"{_fmt(r['bf16_vs_exact']):>10s} {_fmt(r['act_vs_exact']):>12s}"
              + "".join(f"  {name} {_fmt(v) if not isinstance(v, str) else 'ERR ' + v}"
                        for name, v in r.get("out_vs_models", {}).items()))
    if rows:
        def span(key):
            v = [r[key] for r in rows if r[key] is not None]
            return f"{_fmt(min(v))}..{_fmt(max(v))}" if v else "-"
        names = sorted({n for r in rows for n in r.get("out_vs_models", {})})

        def model_span(name):
            v = [r["out_vs_models"][name] for r in rows if not isinstance(r["out_vs_models"].get(name, ""), str)]
            return f"{_fmt(min(v))}..{_fmt(max(v))}" if v else "-"
        print(f"lab_trace: linears: output vs exact {span('out_vs_exact')}, vs the bf16 model {span('out_vs_bf16')}, "
              f"vs the fp8-act model {span('out_vs_act')}"
              + "".join(f", vs {name} {model_span(name)}" for name in names)
              + f"; the models vs exact: bf16 {span('bf16_vs_exact')}, fp8 act {span('act_vs_exact')}")


def _fmt(x) -> str:
    return "-" if x is None else ("inf" if x == math.inf else f"{x:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Compare two forward traces module by module (lab_trace).")
    ap.add_argument("a", help="trace directory (or .pt) taken as the reference, e.g. native")
    ap.add_argument("b", nargs="?", help="trace directory (or .pt) compared with it, e.g. patched")
    ap.add_argument("--floor", help="a second reference trace, e.g. native with its pinned options")
    ap.add_argument("--forward", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--all", action="store_true", help="print every module, not only layers and suspects")
    ap.add_argument("--linears", action="store_true",
                    help="each trace's linears against models of their arithmetic on their own inputs (needs a "
                         "trace taken with params: layer_trace.py does)")
    ap.add_argument("--sglang-models", action="store_true",
                    help="with --linears: native SGLang's own FP8 quantizer and FP8 linear as models too "
                         "(sglang_models; an SM90 GPU)")
    args = ap.parse_args(argv)
    if args.b is None and not args.linears:
        ap.error("give a second trace to compare, or --linears")
    import torch

    def load(p):
        if p is None:
            return None
        if os.path.isdir(p):
            p = os.path.join(p, f"forward-{args.forward}-rank{args.rank}.pt")
        return torch.load(p, weights_only=False)

    a, b, fl = load(args.a), load(args.b), load(args.floor)
    if args.linears:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 models are fp32 products, not TF32 ones
        models = sglang_models() if args.sglang_models else None
        for path, rec in ((args.a, a), (args.b, b)):
            if rec is not None:
                print_linears(path, linear_check(rec, device=device, models=models))
        return 0
    rows = compare(a, b, fl)
    only_a = sorted({r["name"] for r in a} - {r["name"] for r in b})
    only_b = sorted({r["name"] for r in b} - {r["name"] for r in a})
    print(f"lab_trace: {len(rows)} modules compared; only in {args.a}: {len(only_a)}, only in {args.b}: {len(only_b)}")
    for n in (only_a[:10] + only_b[:10]):
        print(f"  unmatched: {n}")
    print(f"  {'module':58s} {'in':>9s} {'out':>9s} {'floor out':>9s}")
    first = None
    for r in rows:
        layer_level = r["name"].count(".") <= 2  # model.embed_tokens, model.layers.N, model.norm
        if r["suspect"] and first is None:
            first = r["name"]
        if args.all or layer_level or r["suspect"]:
            flag = "  <- adds the difference" if r["suspect"] else ""
            print(f"  {r['name'][:58]:58s} {_fmt(r['in']):>9s} {_fmt(r['out']):>9s} {_fmt(r['floor_out']):>9s}{flag}")
    print(f"lab_trace: first module adding the difference: {first or 'none'}")
    # below the suspect bar (1 %) several modules may each add a little: the five that add the most (output
    # difference minus input difference), whatever their size
    grow = sorted((r for r in rows if r["out"] != math.inf), key=lambda r: r["out"] - (r["in"] or 0.0), reverse=True)
    print("lab_trace: largest additions: " + ", ".join(
        f"{r['name']} {_fmt(r['in'])} -> {_fmt(r['out'])}" for r in grow[:5] if r["out"] > (r["in"] or 0.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
