"""python -m dsv4_sm80 doctor | serve | make-tiny | footprint | prebuild-jit

Every subcommand answers bad input with one line on stderr (what was given, what is expected) and a
non-zero exit status; nothing here prints a traceback for a user's mistake.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import time

from . import __version__, env, upstream
from .seams import Seam


class UsageError(Exception):
    """A bad input of a subcommand: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        print(f"{self.prog}: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)


def _number(kind, least, what):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (isinstance(v, int) or math.isfinite(v)) or v < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v
    parse.__name__ = what
    return parse


positive_int = _number(int, 1, "a positive integer")
count = _number(int, 0, "a non-negative integer")
positive_float = _number(float, 1e-9, "a positive number")


def _arch(text):
    from .jit_prebuild import parse_arch

    try:
        parse_arch(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--arch ")) from None
    return text


def _label_parts(text):
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated, non-empty parts of module labels")
    return text


def _model_dir(cmd, path):
    """A --model-path that is no directory: one line, before any gate work."""
    if path is not None and not os.path.isdir(path):
        what = "does not exist" if not os.path.lexists(path) else "is not a directory"
        raise UsageError(f"{cmd}: --model-path {path} {what}; expected the checkpoint directory (config.json, "
                         "model.safetensors.index.json, the shards)")


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
    from . import apply, gate

    _model_dir("doctor", args.model_path)
    if args.as_is:
        patch_environ, assumed = None, []
    else:
        patch_environ, assumed = gate.launch_environ()
    facts, findings = gate.run_gate(args.model_path, patch_environ)
    if args.apply:  # imports the modules of whatever is enabled (nothing with the patch off and no overlay)
        apply.import_targets()
    states = apply.status()
    pkg = facts.sglang.location
    for st in states:
        st["target_check"] = seam_preview(next(s for s in apply.all_seams() if s.name == st["name"]), pkg)
    seam_bad = [s for s in states if s["target_check"] != "ok" or s["state"] == "refused"]
    gate_bad = gate.failures(findings)
    where = ("this shell's environment as it is (--as-is)" if args.as_is else
             "the environment `serve` launches SGLang in, assuming " + "; ".join(assumed)
             + " (--as-is: this shell's environment as it is)")
    if args.json:
        report = json.loads(gate.report(facts, findings, as_json=True))
        report["evaluated_for"] = "as-is" if args.as_is else "serve"
        report["assumed"] = assumed
        report["seams"] = states
        report["ok"] = not gate_bad and not seam_bad
        print(json.dumps(report, indent=2))
    else:
        print(f"doctor: evaluated for {where}")
        print("== gate")
        print(gate.report(facts, findings))
        print(f"== seams ({len(states)} declared; in this process, {env.PATCH.name}="
              f"{os.environ.get(env.PATCH.name, '')!r})")
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
    minutes on an H200), so --watchdog-timeout FIRST_START_WATCHDOG_S is added for this start, with
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
    from . import gate

    model = args.model_path
    lab = env.lab_overrides()
    if model is None:
        if not lab:
            raise UsageError("serve: --model-path is required (the official checkpoint directory); only lab mode "
                             "has an embedded default model")
        model = _lab_model()
    _model_dir("serve", model)
    bind = gate.check_bind(_flag_value(rest, "--host"), bool(_flag_value(rest, "--api-key")))
    if bind.status == "fail":
        print(f"serve: {bind.line()}", file=sys.stderr)
        return 1
    if "WITHOUT" in bind.found:
        print(f"serve: {bind.line()}", file=sys.stderr)
    # before SGLang parses its arguments: its DSV4 hook asserts on NEXTN (deepseek_v4_hook.py:55-59) before the
    # in-launch gate could name the reason, the missing e_proj/h_proj draft
    algo = _flag_value(rest, "--speculative-algorithm")
    if algo:
        spec = gate.check_speculative(algo, gate.collect_model(model))
        if spec.status == "fail":
            print(f"serve: {spec.line()}", file=sys.stderr)
            return 1
    launch_env, _ = gate.launch_environ()
    tokenizer = not ("--skip-tokenizer-init" in rest or _flag_value(rest, "--tokenizer-path") is not None)
    rc = gate.run(model, patch_environ=launch_env, tokenizer=tokenizer)
    if rc:
        return rc
    rest, note = first_start_args(rest, launch_env)
    if note:
        print(note, flush=True)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, *rest]
    print("serve:", " ".join(redact(cmd)), flush=True)
    os.execvpe(sys.executable, cmd, launch_env)


# --- make-tiny ---------------------------------------------------------------------------------

def _target_dir(path: str, force: bool) -> None:
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"make-tiny: {path} exists and is not a directory; expected a new or empty directory "
                         "to write the checkpoint into")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise UsageError(f"make-tiny: {path} is not empty; expected a new or empty directory (--force writes "
                         "into it, replacing the checkpoint files there)")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".make-tiny-probe")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"make-tiny: cannot write into {path} ({e.strerror or e}); expected a directory this "
                         "user can write") from None


def _progress(stream):
    """make-tiny's progress line (tensors written / total, bytes), redrawn at most twice a second."""
    last = [0.0]

    def show(done, total, nbytes):
        now = time.monotonic()
        if done == total or now - last[0] >= 0.5:
            last[0] = now
            stream.write(f"\rmake-tiny: {done}/{total} tensors, {nbytes / 2**30:.2f} GiB written"
                         + ("\n" if done == total else ""))
            stream.flush()
    return show


def make_tiny(args) -> int:
    from dataclasses import replace

    from .checkpoint import format as fmt
    from .tiny.generate import FAST_EXPERT_PRESETS, PRESETS, TinyConfigError, generate, tiny_config

    size = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "o_groups", "q_lora", "o_lora",
                                                "moe_inter", "experts", "vocab") if getattr(args, k) is not None}
    try:
        config = tiny_config(replace(size, **overrides), vision=args.vision)
    except TinyConfigError as e:
        raise UsageError(f"make-tiny: {e}") from None
    _target_dir(args.out_dir, args.force)
    total = sum(s.nbytes for s in fmt.inventory(config))
    print(f"make-tiny: writing {total / 2**30:.2f} GiB ({args.preset} preset) into {args.out_dir}", flush=True)
    try:
        generate(args.out_dir, config, seed=args.seed, head_scale=args.head_scale,
                 fast_experts=args.fast_experts or args.preset in FAST_EXPERT_PRESETS,
                 progress=_progress(sys.stderr) if sys.stderr.isatty() else None)
    except OSError as e:
        raise UsageError(f"make-tiny: writing {args.out_dir} failed ({e.strerror or e}: {e.filename or ''}); "
                         "expected room and write access there") from None
    return 0


# --- footprint ----------------------------------------------------------------------------------

def _footprint_config(path: str) -> dict:
    from .gate import model_checks

    if not os.path.isfile(path):
        what = "does not exist" if not os.path.lexists(path) else "is not a regular file"
        raise UsageError(f"footprint: {path} {what}; expected a checkpoint's config.json")
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"footprint: {path} cannot be read as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"footprint: {path} holds a JSON {type(cfg).__name__}, expected an object (a config.json)")
    problems = model_checks.config_type_problems(cfg) or model_checks.config_value_problems(cfg)
    if problems:
        raise UsageError(f"footprint: {path}: {problems[0]}")
    return cfg


def footprint(args) -> int:
    from . import footprint as fp
    from .checkpoint import format as fmt

    if args.model_path or args.config:
        if args.model_path and not args.config:
            _model_dir("footprint", args.model_path)
        path = args.config or os.path.join(args.model_path, "config.json")
        configs = {path: _footprint_config(path)}
    else:
        configs = {"DeepSeek-V4-Flash-0731 (config from dsv4_sm80.checkpoint.format)": fmt.flash_0731_config(),
                   "DeepSeek-V4-Flash-Vision-Exp": fmt.vision_exp_config()}
    kw = dict(tp=args.tp, gpu_gib=args.gpu_gib, draft=not args.no_draft, speculative=not args.no_draft,
              max_running_requests=args.max_running_requests, context=args.context)
    for name, cfg in configs.items():
        try:
            text = fp.report(cfg, **kw)
        except (fmt.FormatError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            raise UsageError(f"footprint: {name}: the arithmetic stopped on {type(e).__name__}: {e}") from None
        print(f"== {name}")
        print(text)
    return 0


# --- prebuild-jit ---------------------------------------------------------------------------------

def prebuild_jit(args) -> int:
    if args.out:
        parent = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise UsageError(f"prebuild-jit: --out {args.out}: expected a file path in a writable directory")
    from . import jit_prebuild

    return jit_prebuild.run(args)


# --- the parser -----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m dsv4_sm80", description="DeepSeek-V4-Flash on SGLang 0.5.16 on SM80 (A800/A100).")
    ap.add_argument("--version", action="version", version=f"dsv4-sm80 {__version__}",
                    help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    d = sub.add_parser("doctor", help="will `serve` start here? the gate's checks and the seam status",
                       description="The gate's checks as `serve` would run them (its launch environment: the patch "
                                   "switch and PYTHONPATH it sets), then the seam status.")
    d.add_argument("--model-path", help="the checkpoint directory to check")
    d.add_argument("--json", action="store_true", help="the report as JSON")
    d.add_argument("--apply", action="store_true", help="import every seam target now (imports SGLang)")
    d.add_argument("--as-is", action="store_true",
                   help="evaluate this shell's environment as it is, not the one `serve` launches in")
    s = sub.add_parser("serve", help="gate, then SGLang's launch_server with the patch on; "
                                     "unknown arguments go to SGLang")
    s.add_argument("--model-path", help="the official checkpoint directory (lab mode: a tiny one by default)")
    t = sub.add_parser("make-tiny", help="write a tiny official-format checkpoint")
    t.add_argument("out_dir", help="a new or empty directory to write into")
    t.add_argument("--preset", default="tiny", choices=("tiny", "unit", "wide", "full"),
                   help="tiny: the GPU bed's (~0.5 GB); unit: CPU tests' (~20 MB); wide: the real widths, 4 layers "
                        "(~26 GB); full: the real depth at one TP4 rank's widths, for TP1 (~43 GB)")
    widths = {"hidden": "hidden size (multiple of 128)", "layers": "decoder layers (at least 4)",
              "heads": "attention heads", "o_groups": "output-projection groups", "q_lora": "query LoRA rank "
              "(multiple of 128)", "o_lora": "output LoRA rank (multiple of 128)", "moe_inter": "expert intermediate "
              "size (multiple of 128)", "experts": "routed experts (at least 6)", "vocab": "vocabulary size "
              "(--vision needs 129280)"}
    for k, what in widths.items():
        t.add_argument("--" + k.replace("_", "-"), dest=k, type=positive_int, help=f"override the preset's {what}")
    t.add_argument("--seed", type=count, default=0, help="the weights' random seed (default 0)")
    t.add_argument("--vision", action="store_true", help="add the Vision-Exp tensors and config fields")
    t.add_argument("--head-scale", type=positive_float, default=1.0,
                   help="scale the LM head for peaked next-token distributions (e.g. 12)")
    t.add_argument("--fast-experts", action="store_true",
                   help="random MXFP4 expert codes instead of quantized draws (default for --preset wide and full)")
    t.add_argument("--force", action="store_true", help="write into a directory that is not empty")
    f = sub.add_parser("footprint", help="per-GPU memory arithmetic for a checkpoint config on this datapath")
    f.add_argument("--model-path", help="a checkpoint directory (its config.json)")
    f.add_argument("--config", help="a config.json (default: the release's own two configs)")
    f.add_argument("--tp", type=positive_int, default=4, help="tensor-parallel size (default 4)")
    f.add_argument("--gpu-gib", type=positive_float, default=80.0, help="memory per GPU in GiB (default 80)")
    f.add_argument("--no-draft", action="store_true", help="without the DSPARK draft (no speculative decoding)")
    f.add_argument("--context", type=positive_int, default=524288, help="tokens per request (default 524288)")
    f.add_argument("--max-running-requests", type=positive_int, default=256,
                   help="SGLang's --max-running-requests (default 256)")
    j = sub.add_parser("prebuild-jit", help="build SGLang's JIT modules this path calls, for sm_80 by default, "
                                            "several at a time, before the first start (no GPU needed)")
    j.add_argument("--arch", default="8.0", type=_arch,
                   help="target arch, SGLang's spelling: 8.0 (A800/A100), 9.0a (H200); gpu: the visible GPU's")
    j.add_argument("--jobs", type=positive_int, help="builds at a time (default: the CPU count)")
    j.add_argument("--all-modes", action="store_true",
                   help="also the modules of the modes not chosen now (fp8_marlin dense, marlin experts)")
    j.add_argument("--only", type=_label_parts, help="comma-separated parts of module labels")
    j.add_argument("--out", help="a JSON record of each build, errors in full")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args, rest = ap.parse_known_args(argv)
    if args.cmd != "serve" and rest:
        ap.error(f"{args.cmd}: unrecognized arguments: {' '.join(rest)}")
    run = {"serve": lambda: serve(args, rest), "doctor": lambda: doctor(args), "make-tiny": lambda: make_tiny(args),
           "footprint": lambda: footprint(args), "prebuild-jit": lambda: prebuild_jit(args)}[args.cmd]
    try:
        return run()
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{args.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (e.g. `| head`) went away: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
