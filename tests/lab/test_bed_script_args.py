"""The GPU scripts' arguments to SGLang, checked on the CPU against the real sglang 0.5.16, so a misspelt
keyword or flag fails here and not after minutes of device time (e.g. `cuda_graph_max_bs`, which 0.5.16 names
`cuda_graph_max_bs_decode`).

- keywords of every `sglang.Engine(...)` / `ServerArgs(...)` call in dsv4_lab/beds and bench, plus the string keys
  of dicts splatted into them (`**extra`), must be ServerArgs fields;
- every `--flag` in the server argument lists (`serve_args` and what is added to it) must be an option of
  SGLang's own launch_server parser or of `python -m dsv4_sm80 serve`."""

import argparse
import ast
import dataclasses
import glob
import os

import pytest

from conftest import REPO

pytestmark = pytest.mark.sglang

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "dsv4_lab", "beds", "*.py"))
                 + glob.glob(os.path.join(REPO, "bench", "*.py")))


def _str_keys(func: ast.AST, name: str) -> set:
    """String keys given to dict `name` inside `func`: dict literals assigned to it, name["key"] = ..."""
    keys = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == name:
                    for sub in ast.walk(node.value):
                        if isinstance(sub, ast.Dict):
                            keys |= {k.value for k in sub.keys
                                     if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name
                        and isinstance(t.slice, ast.Constant)):
                    keys.add(t.slice.value)
    return keys


def engine_keywords(path: str) -> set:
    tree = ast.parse(open(path).read())
    out = set()
    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Module))]:
        for node in ast.walk(func):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in ("Engine", "ServerArgs"):
                    for kw in node.keywords:
                        if kw.arg is not None:
                            out.add(kw.arg)
                        elif isinstance(kw.value, ast.Name):
                            out |= _str_keys(func, kw.value.id)
    return out


def server_flags(path: str) -> set:
    """--flags in list literals assigned or added to serve_args."""
    tree = ast.parse(open(path).read())
    flags = set()
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        if target == "serve_args":
            for sub in ast.walk(value):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.startswith("--"):
                    flags.add(sub.value)
    return flags


def test_engine_keywords_are_server_args_fields():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    seen = {}
    for path in SCRIPTS:
        for kw in engine_keywords(path):
            seen.setdefault(kw, []).append(os.path.relpath(path, REPO))
    assert "cuda_graph_max_bs_decode" in seen and "model_path" in seen  # the scan finds them
    bad = {k: v for k, v in seen.items() if k not in fields}
    assert not bad, f"not ServerArgs fields in sglang 0.5.16: {bad}"


def test_server_flags_are_known_options():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = {s for a in parser._actions for s in a.option_strings}
    seen = {}
    for path in SCRIPTS:
        for flag in server_flags(path):
            seen.setdefault(flag, []).append(os.path.relpath(path, REPO))
    assert "--api-key" in seen and "--model-path" in seen
    bad = {k: v for k, v in seen.items() if k not in known}
    assert not bad, f"not launch_server options in sglang 0.5.16: {bad}"


def test_http_check_refused_start_harness():
    """http_check's refused-start check on this CPU machine, where the gate refuses every start (no GPU): a
    refusal naming the wanted check passes, one naming another check fails and says what it found."""
    from dsv4_lab.beds import http_check

    lab = {"DSV4_SM80_LAB_GPU_COUNT": "1", "DSV4_SM80_LAB_CC": "9.0"}
    good, line = http_check.refused_start(30999, ["--api-key", "k"], "FAIL gpu.count", lab, timeout=240)
    assert good and line.startswith("exit 1: FAIL gpu.count"), line
    good, line = http_check.refused_start(30999, ["--api-key", "k"], "moe.expert_parallel", lab, timeout=240)
    assert not good and "'moe.expert_parallel' not named" in line, line
    assert [name for name, _, _ in http_check.REFUSED_STARTS] == [
        "expert parallelism", "NextN speculative decoding", "another MoE runner", "HiSparse", "DP attention"]
