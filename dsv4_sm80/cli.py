"""python -m dsv4_sm80 doctor | serve | make-tiny"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

from . import env, upstream
from .seams import Seam



# --- doctor ------------------------------------------------------------------------------------

def _defined(tree: ast.Module, path: tuple) -> bool:
    """Is module attribute path (e.g. ('Engine', '_launch_subprocesses')) defined in the source?"""
    scope = tree.body
    for i, name in enumerate(path):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = node
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                found = node
            elif isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                found = node  # a module global bound by import (e.g. mxfp4_marlin_moe.is_sm90_supported)
        if found is None:
            return False
        if i < len(path) - 1:
            if not isinstance(found, ast.ClassDef):
                return False
            scope = found.body
    return True


def seam_preview(seam: Seam, pkg_dir) -> str:
    """Static check, without importing SGLang: is the target file the 0.5.16 one, is the target there?"""
    if pkg_dir is None:
        return "no sglang package"
    rel = seam.upstream_file
    problem = upstream.mismatches(pkg_dir, {rel: upstream.FINGERPRINTS.get(rel)}).get(rel)
    if problem == "missing":
        return f"missing file {rel}"
    if problem:
        return f"{rel} is not the 0.5.16 file"
    path = os.path.join(pkg_dir, rel)
    if not _defined(ast.parse(open(path, encoding="utf-8").read()), seam.attr_path):
        return f"target {seam.target} not defined"
    return "ok"


def doctor(args) -> int:
    import compat_check

    from . import apply

    compat_check.banner_once()
    facts = compat_check.collect(args.model_path)
    findings = compat_check.evaluate(facts)
    if args.apply:  # imports the modules of whatever is enabled (nothing with the patch off and no overlay)
        apply.import_targets()
    states = apply.status()
    pkg = facts.sglang.location
    for st in states:
        st["target_check"] = seam_preview(next(s for s in apply.all_seams() if s.name == st["name"]), pkg)
    seam_bad = [s for s in states if s["target_check"] != "ok" or s["state"] == "refused"]
    gate_bad = compat_check.failures(findings)
    if args.json:
        report = json.loads(compat_check.report(facts, findings, as_json=True))
        report["seams"] = states
        report["ok"] = not gate_bad and not seam_bad
        print(json.dumps(report, indent=2))
    else:
        print("== gate")
        print(compat_check.report(facts, findings))
        print(f"== seams ({len(states)} declared; {env.PATCH.name}={os.environ.get(env.PATCH.name, '')!r})")
        for st in states:
            detail = f" - {st['detail']}" if st["detail"] else ""
            print(f"{st['state'].upper():8s} {st['name']}: {st['target']} [{st['kind']}, upstream {st['upstream']}, "
                  f"toggle {st['toggle']}] target {st['target_check']}{detail}")
        applied = sum(s["state"] == "applied" for s in states)
        print(f"seams: {applied} applied in this process"
              + ("" if applied or env.patch_enabled() else " (patch off and no overlay switched on: none is applied)"))
    return 1 if gate_bad or seam_bad else 0


# --- serve -------------------------------------------------------------------------------------

def _lab_model() -> str:
    """The embedded default model of lab mode: the tiny checkpoint, generated once."""
    from .tiny.generate import PRESETS, generate, tiny_config

    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsv4_sm80", "tiny-s0-tok")
    if not os.path.isfile(os.path.join(cache, "model.safetensors.index.json")):
        generate(cache, tiny_config(PRESETS["tiny"]), seed=0, head_scale=12.0)
    return cache


SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password")


def _flag_value(argv, flag):
    """The value of `flag` in an argv list (`--flag V` or `--flag=V`), the last one wins; None if absent."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def redact(argv):
    """argv with the values of secret flags replaced by ***, for anything printed or logged."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a in SECRET_FLAGS:
            out.append(a)
            hide = True
        elif a.split("=", 1)[0] in SECRET_FLAGS and "=" in a:
            out.append(a.split("=", 1)[0] + "=***")
        else:
            out.append(a)
    return out


FIRST_START_WATCHDOG_S = 1800


def first_start_args(rest: list, environ=None) -> tuple:
    """(rest, note): on a host whose Triton cache holds none of this path's kernels (jitcache.ours_built) or whose
    SGLang JIT (tvm-ffi) cache is empty or lacks a module the configured modes build at their first forward
    (jitcache.FIRST_FORWARD_MODULES) (a cold first start), SGLang's scheduler watchdog (300 s) would kill the
    first forward while it compiles (native SGLang's cold first forward of this model: still compiling after 7.5
    minutes on an H200, session 11), so --watchdog-timeout FIRST_START_WATCHDOG_S is added for this start, with
    a note saying so. A user's own --watchdog-timeout always wins; a warm cache changes nothing."""
    from . import jitcache

    if _flag_value(rest, "--watchdog-timeout") is not None:
        return rest, None
    cold = jitcache.cold_reasons(environ)
    if not cold:
        return rest, None
    return [*rest, "--watchdog-timeout", str(FIRST_START_WATCHDOG_S)], (
        f"serve: first start on this host ({'; '.join(cold)}): the first forward compiles for minutes, so "
        f"SGLang's scheduler watchdog is {FIRST_START_WATCHDOG_S} s for this start (--watchdog-timeout to choose; "
        "keep the cache directories to start warm next time; `python -m dsv4_sm80 prebuild-jit` builds SGLang's JIT "
        "modules ahead, several at a time)")


def serve(args, rest) -> int:
    import compat_check

    model = args.model_path
    lab = env.lab_overrides()
    if model is None:
        if not lab:
            print("serve: --model-path is required (the official checkpoint directory); "
                  "only lab mode has an embedded default model", file=sys.stderr)
            return 2
        model = _lab_model()
    if (not os.path.isfile(os.path.join(model, "tokenizer.json"))
            and not any(a.startswith("--tokenizer") or a == "--skip-tokenizer-init" for a in rest)):
        rest = ["--skip-tokenizer-init", *rest]  # a checkpoint without a tokenizer: token ids only
    bind = compat_check.check_bind(_flag_value(rest, "--host"), bool(_flag_value(rest, "--api-key")))
    if bind.status == "fail":
        print(f"serve: {bind.line()}", file=sys.stderr)
        return 1
    if "WITHOUT" in bind.found:
        print(f"serve: {bind.line()}", file=sys.stderr)
    # before SGLang parses its arguments: its DSV4 hook asserts on NEXTN (deepseek_v4_hook.py:55-59) before the
    # in-launch gate (launch_gate.py) could name the reason, the missing e_proj/h_proj draft (seen on the H200)
    algo = _flag_value(rest, "--speculative-algorithm")
    if algo:
        spec = compat_check.check_speculative(algo, compat_check.collect_model(model))
        if spec.status == "fail":
            print(f"serve: {spec.line()}", file=sys.stderr)
            return 1
    launch_env = dict(os.environ)
    launch_env[env.PATCH.name] = "1"
    # The platform directory (sitecustomize, compat_check) first, then the patch body's directory.
    overlay = [os.path.dirname(os.path.abspath(compat_check.__file__)),
               os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    path = [p for p in launch_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    launch_env["PYTHONPATH"] = os.pathsep.join([d for d in dict.fromkeys(overlay) if d not in path] + path)
    rc = compat_check.run(model, patch_environ=launch_env)
    if rc:
        return rc
    rest, note = first_start_args(rest, launch_env)
    if note:
        print(note, flush=True)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *rest]
    print("serve:", " ".join(redact(cmd)), flush=True)
    os.execvpe(sys.executable, cmd, launch_env)


# --- make-tiny ---------------------------------------------------------------------------------

def make_tiny(args) -> int:
    from dataclasses import replace

    from .tiny.generate import PRESETS, TinyConfigError, generate, tiny_config

    size = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "o_groups", "q_lora", "o_lora",
                                                "moe_inter", "experts", "vocab") if getattr(args, k) is not None}
    try:
        config = tiny_config(replace(size, **overrides), vision=args.vision)
    except TinyConfigError as e:
        print(f"make-tiny: {e}", file=sys.stderr)
        return 2
    generate(args.out_dir, config, seed=args.seed, head_scale=args.head_scale,
             fast_experts=args.fast_experts or args.preset == "wide")
    return 0


# --- footprint ----------------------------------------------------------------------------------

def footprint(args) -> int:
    import json as _json

    from . import footprint as fp
    from .checkpoint import format as fmt

    if args.model_path or args.config:
        path = args.config or os.path.join(args.model_path, "config.json")
        with open(path) as f:
            configs = {path: _json.load(f)}
    else:
        configs = {"DeepSeek-V4-Flash-0731 (config from dsv4_sm80.checkpoint.format)": fmt.flash_0731_config(),
                   "DeepSeek-V4-Flash-Vision-Exp": fmt.vision_exp_config()}
    kw = dict(tp=args.tp, gpu_gib=args.gpu_gib, draft=not args.no_draft, speculative=not args.no_draft,
              max_running_requests=args.max_running_requests, context=args.context)
    for name, cfg in configs.items():
        print(f"== {name}")
        print(fp.report(cfg, **kw))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_sm80")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="the gate and the seam status")
    d.add_argument("--model-path")
    d.add_argument("--json", action="store_true")
    d.add_argument("--apply", action="store_true", help="import every seam target now (imports SGLang)")
    s = sub.add_parser("serve", help="gate, then SGLang's launch_server with the patch on; "
                                     "unknown arguments go to SGLang")
    s.add_argument("--model-path")
    t = sub.add_parser("make-tiny", help="write a tiny official-format checkpoint")
    t.add_argument("out_dir")
    t.add_argument("--preset", default="tiny", choices=("tiny", "unit", "wide"))
    for k in ("hidden", "layers", "heads", "o_groups", "q_lora", "o_lora", "moe_inter", "experts", "vocab"):
        t.add_argument("--" + k.replace("_", "-"), dest=k, type=int)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--vision", action="store_true", help="add the Vision-Exp tensors and config fields")
    t.add_argument("--head-scale", type=float, default=1.0,
                   help="scale the LM head for peaked next-token distributions (e.g. 12)")
    t.add_argument("--fast-experts", action="store_true",
                   help="random MXFP4 expert codes instead of quantized draws (default for --preset wide)")
    f = sub.add_parser("footprint", help="per-GPU memory arithmetic for a checkpoint config on this datapath")
    f.add_argument("--model-path")
    f.add_argument("--config")
    f.add_argument("--tp", type=int, default=4)
    f.add_argument("--gpu-gib", type=float, default=80.0)
    f.add_argument("--no-draft", action="store_true", help="without the DSPARK draft (no speculative decoding)")
    f.add_argument("--context", type=int, default=524288)
    f.add_argument("--max-running-requests", type=int, default=256)
    j = sub.add_parser("prebuild-jit", help="build SGLang's JIT modules this path calls, for sm_80 by default, "
                                            "several at a time, before the first start (no GPU needed)")
    j.add_argument("--arch", default="8.0",
                   help="target arch, SGLang's spelling: 8.0 (A800/A100), 9.0a (H200); gpu: the visible GPU's")
    j.add_argument("--jobs", type=int, help="builds at a time (default: the CPU count)")
    j.add_argument("--all-modes", action="store_true",
                   help="also the modules of the modes not chosen now (fp8_marlin dense, marlin experts)")
    j.add_argument("--only", help="comma-separated parts of module labels")
    j.add_argument("--out", help="a JSON record of each build, errors in full")
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "serve":
        return serve(args, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "footprint":
        return footprint(args)
    if args.cmd == "prebuild-jit":
        from . import jit_prebuild

        return jit_prebuild.run(args)
    return doctor(args) if args.cmd == "doctor" else make_tiny(args)
