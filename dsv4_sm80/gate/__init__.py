"""The fail-fast gate of dsv4-sm80, assembled once: facts collected once (`facts`; a launch_server command line
read by `argv`), pure checks (`checks`, `model_checks`, `inventory`), one report (`report`). `doctor`, `serve` (the
container entrypoint runs them), `compat_check.py` and SGLang's own launch (the launch stage,
`dsv4_sm80/stages/launch.py`) all run `run_gate`; every refusal of the product is one of its findings.

Order: compatibility (SGLang 0.5.16 @ fdebc938, exactly 4 visible GPUs of compute capability 8.0,
their interconnect, the knobs, the JIT caches and compiler), the config, the patch, then the checkpoint files (index,
every shard's header, the native inventory) and the tokenizer; with server arguments, then the speculative draft,
the unverified modes, the bind rule and the stages' rules on SGLang's arguments (`seams.SERVER_ARGS`). Lab
overrides (DSV4_SM80_LAB_GPU_COUNT, DSV4_SM80_LAB_CC) relax only the GPU checks, are never defaults, and print a
banner on every run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import asdict

from .. import env
from ..seams import SERVER_ARGS
from .checks import (
    COUNT_MODES,
    UNVERIFIED_MODES,
    check_bind,
    check_env_knobs,
    check_gpus,
    check_interconnect,
    check_jit_cache,
    check_jit_compiler,
    check_modes,
    check_patch,
    check_server_arg,
    check_sglang,
    check_sglang_knobs,
    check_speculative,
    interconnect_launch_args,
    server_arg_settings,
)
from .facts import (
    Facts,
    GpuFacts,
    InterconnectFacts,
    ModelFacts,
    PatchFacts,
    SGLangFacts,
    collect,
    collect_gpus,
    collect_interconnect,
    collect_model,
    collect_sglang,
    tokenizer_wanted,
)
from .model_checks import check_model_config, check_model_files, check_tokenizer
from .report import Finding, GateRefused, banner_once, failures, guarded, refusal, report, verdict

__all__ = ["COUNT_MODES", "UNVERIFIED_MODES", "Facts", "Finding", "GateRefused", "GpuFacts", "InterconnectFacts",
           "ModelFacts", "PatchFacts", "SGLangFacts", "check_bind", "check_interconnect", "check_server_arg",
           "check_jit_cache", "check_jit_compiler", "check_model_files", "check_modes", "check_speculative", "collect",
           "collect_gpus", "collect_interconnect", "collect_model", "collect_sglang", "evaluate", "failures",
           "interconnect_launch_args", "launch_environ", "launch_settings", "refusal", "report", "run",
           "run_gate", "run_sglang_only", "tokenizer_wanted", "verdict"]


def evaluate(facts: Facts, server_args=None) -> list[Finding]:
    """Every check, in the gate's order; with `server_args` (SGLang's at launch, or `argv.server_args` of a command
    line) also the speculative draft, the server's modes and bind address and the stages' rules on its arguments. A
    check that raises is its own FAIL line."""
    m = facts.model
    out = (guarded("sglang.installed", check_sglang, facts.sglang)
           + guarded("gpu.count", check_gpus, facts.gpus, facts.lab)
           + guarded("gpu.interconnect", check_interconnect, facts.interconnect)
           + guarded("env.knobs", check_env_knobs, facts.knobs)
           + guarded("jit.cache", check_jit_cache, facts.jit)
           + guarded("jit.compiler", check_jit_compiler, facts.nvcc)
           + guarded("model.config", check_model_config, m)
           + guarded("patch.active", check_patch, facts.patch)
           + guarded("patch.sglang_knobs", check_sglang_knobs, facts.patch)
           + guarded("model.files", check_model_files, m)
           + guarded("model.tokenizer", check_tokenizer, m))
    if server_args is not None:
        out += (guarded("speculative.draft", check_speculative, getattr(server_args, "speculative_algorithm", None), m)
                + guarded("server.modes", check_modes, server_args)
                + guarded("server.bind", check_bind, getattr(server_args, "host", None),
                          bool(getattr(server_args, "api_key", None))))
        for rule in SERVER_ARGS:
            out += guarded(rule.name, check_server_arg, rule, server_args)
    return out


def launch_settings(facts: Facts, server_args) -> dict:
    """attribute -> value: every server argument the launch sets, the stages' rules and the interconnect's."""
    return {**server_arg_settings(server_args), **interconnect_launch_args(facts.interconnect)}


def run_gate(model_path: str | None = None, patch_environ: dict | None = None, tokenizer: bool = True,
             server_args=None) -> tuple[Facts, list[Finding]]:
    """The facts (of this interpreter, or of a process started with `patch_environ`) and the findings."""
    banner_once()
    facts = collect(model_path, patch_environ, tokenizer)
    return facts, evaluate(facts, server_args)


def run(model_path=None, patch_environ=None, as_json=False, stream=None, tokenizer=True, server_args=None) -> int:
    facts, findings = run_gate(model_path, patch_environ, tokenizer, server_args)
    print(report(facts, findings, as_json), file=stream or sys.stdout, flush=True)
    return 1 if failures(findings) else 0


def run_sglang_only(as_json=False, stream=None) -> int:
    """Only the SGLang checks (version, location, commit, clean tree, fingerprint): what docker/build.sh
    asks of a base image before building on it; no GPU, patch or model facts are collected."""
    stream = stream or sys.stdout
    facts = collect_sglang()
    findings = guarded("sglang.installed", check_sglang, facts)
    bad = failures(findings)
    if as_json:
        print(json.dumps({"ok": not bad, "checks": [asdict(f) for f in findings], "sglang": asdict(facts)}, indent=2),
              file=stream, flush=True)
    else:
        lines = [f.line() for f in findings] + [f"gate (sglang only): {'REFUSED' if bad else 'passed'}"]
        print("\n".join(lines), file=stream, flush=True)
    return 1 if bad else 0


def overlay_dirs() -> list[str]:
    """The directories a launched process needs first on PYTHONPATH: the platform one (sitecustomize and
    compat_check.py, found without importing them), then the one holding this package."""
    spec = importlib.util.find_spec("compat_check")
    platform = [os.path.dirname(os.path.abspath(spec.origin))] if spec and spec.origin else []
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return list(dict.fromkeys(platform + [package_parent]))


def launch_environ(environ=None) -> tuple[dict, list[str]]:
    """(the environment `serve` launches SGLang in, the knobs it sets there as NAME=value lines). The patch switch
    is turned on; a value outside its column is left as it is, for the gate to refuse by name."""
    out = dict(os.environ if environ is None else environ)
    assumed = []
    try:
        env.get(env.PATCH, out)
    except env.EnvError:
        assumed.append(f"{env.PATCH.name}={out[env.PATCH.name]!r} as set, outside its column")
    else:
        out[env.PATCH.name] = "1"
        assumed.append(f"{env.PATCH.name}=1")
    path = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    front = [d for d in overlay_dirs() if d not in path]
    out["PYTHONPATH"] = os.pathsep.join(front + path)
    assumed += [f"PYTHONPATH starts with {os.pathsep.join(front)}"] if front else []
    return out, assumed


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="compat_check", description="The fail-fast gate of dsv4-sm80: every check, "
                                 "one line each; exit status 1 if any fails (nothing should start then).")
    ap.add_argument("--model-path", help="the checkpoint directory to check (the official release)")
    ap.add_argument("--json", action="store_true", help="the report as JSON")
    ap.add_argument("--sglang-only", action="store_true", help="only the SGLang checks (for image builds)")
    ap.add_argument("--skip-tokenizer", action="store_true",
                    help="the server runs with --skip-tokenizer-init: do not check the tokenizer files")
    args = ap.parse_args(argv)
    if args.sglang_only:
        return run_sglang_only(as_json=args.json)
    if not args.json:
        print(f"gate: evaluated for this interpreter's environment ({env.PATCH.name}="
              f"{os.environ.get(env.PATCH.name, '')!r}); `python -m dsv4_sm80 doctor` evaluates the one `serve` "
              "launches SGLang in, where serve sets the switch", flush=True)
    return run(args.model_path, as_json=args.json, tokenizer=not args.skip_tokenizer)
