"""python -m dsv4_sm80 doctor | serve | make-tiny | footprint | prebuild-jit

Every subcommand answers bad input with one line on stderr (what was given, what is expected) and a
non-zero exit status; nothing here prints a traceback for a user's mistake.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from . import __version__, env


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


# --- doctor, serve ------------------------------------------------------------------------------

def _server_args(cmd, model, rest):
    """SGLang's arguments after ours, as the gate reads them (`gate.argv`); a stray word is refused here."""
    from .gate import argv

    if rest and not rest[0].startswith("-"):
        raise UsageError(f"{cmd}: unrecognized arguments: {' '.join(rest)}; expected SGLang launch_server options "
                         "(--name value) after this command's own")
    return argv.server_args(([] if model is None else ["--model-path", model]) + rest)


def doctor(args, rest) -> int:
    from .doctor import doctor as report

    _model_dir("doctor", args.model_path)
    return report(args.model_path, _server_args("doctor", args.model_path, rest), args.as_is, args.apply, args.json)


def serve(args, rest) -> int:
    from . import gate
    from .gate.argv import redact
    from .stages.launch import first_start_args

    model = args.model_path
    if model is None:
        if not env.lab_overrides():
            raise UsageError("serve: --model-path is required (the official checkpoint directory); only lab mode "
                             "has an embedded default model")
        from .tiny.generate import lab_checkpoint

        model = lab_checkpoint()
    _model_dir("serve", model)
    server_args = _server_args("serve", model, rest)
    launch_env, _ = gate.launch_environ()
    rc = gate.run(model, patch_environ=launch_env, tokenizer=gate.tokenizer_wanted(server_args),
                  server_args=server_args)
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
    d = sub.add_parser("doctor", help="will `serve` start here? the gate's checks and the seam status; unknown "
                                      "arguments are SGLang's, judged as serve judges them",
                       description="The gate's checks as `serve` would run them (its launch environment: the patch "
                                   "switch and PYTHONPATH it sets), then the seam status.")
    d.add_argument("--model-path", help="the checkpoint directory to check")
    d.add_argument("--json", action="store_true", help="the report as JSON")
    d.add_argument("--apply", action="store_true",
                   help="import every pending seam's module now, in the evaluated environment (imports SGLang)")
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
    if args.cmd not in ("serve", "doctor") and rest:
        ap.error(f"{args.cmd}: unrecognized arguments: {' '.join(rest)}")
    run = {"serve": lambda: serve(args, rest), "doctor": lambda: doctor(args, rest),
           "make-tiny": lambda: make_tiny(args), "footprint": lambda: footprint(args),
           "prebuild-jit": lambda: prebuild_jit(args)}[args.cmd]
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
