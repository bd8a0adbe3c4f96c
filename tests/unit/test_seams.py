"""The seam table and its one applier, against the real sglang==0.5.16."""

import os
import re

import pytest

from conftest import last_json, run_python
from dsv4_sm80 import apply
from dsv4_sm80.seams import SEAMS, SERVER_ARGS, STAGES, Seam, order_problems, validate_table
from dsv4_sm80.upstream import locate_sglang, target_state
from vision_backport.seams import VISION_SEAMS

ALL = (*SEAMS, *VISION_SEAMS)  # the product's table, then the vision overlay's, as the applier appends them

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def sglang_dir():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; the seam tests need the real one")
    return locate_sglang()


def test_table_is_well_formed():
    assert validate_table() == [] and validate_table(VISION_SEAMS) == [] and validate_table(ALL) == []
    assert {s.overlay for s in SEAMS} == {"sm80"} and {s.overlay for s in VISION_SEAMS} == {"vision"}
    assert all(s.name.startswith("vision.") and s.replacement.startswith("vision_backport.") for s in VISION_SEAMS)
    assert apply.all_seams({}) == ALL  # the lab's table joins only with its switch


def test_table_keeps_its_order_rule():
    """One block per stage in STAGES order, each replacement in its stage's file; one seam on SGLang's launch."""
    assert order_problems() == []
    assert [s.name.split(".")[0] for s in SEAMS] == sorted((s.name.split(".")[0] for s in SEAMS), key=STAGES.index)
    assert [s.name for s in SEAMS if s.target.endswith("Engine._launch_subprocesses")] == ["launch.gate"]
    swapped = (SEAMS[3], *SEAMS[:3], *SEAMS[4:])  # a dense seam ahead of the launch block
    assert order_problems(swapped) == ["launch.gate: the launch block comes after dense, against STAGES",
                                       "dense.weight_loader_v2: a second dense block (after launch)"]
    stray = Seam("dense.x", "sglang.srt.entrypoints.engine:Engine.f", "around", "dsv4_sm80.stages.moe:f", "r",
                 "srt/entrypoints/engine.py:1")
    assert order_problems([*SEAMS, stray]) == ["dense.x: replacement dsv4_sm80.stages.moe:f is not in "
                                               "dsv4_sm80/stages/dense.py", "dense.x: a second dense block (after "
                                               "requests)"]


def test_server_arg_rules_hold_against_sglangs_parser(sglang_dir):
    """Each stage's rule names a real ServerArgs field, its flag and SGLang's own default, in a fingerprinted file."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from dsv4_sm80.upstream import FINGERPRINTS

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    actions = {a.dest: a for a in parser._actions}
    for rule in SERVER_ARGS:
        stage = rule.name.split(".")[0]
        assert stage in STAGES and rule.attr in actions, rule.name
        assert rule.flag in actions[rule.attr].option_strings and str(actions[rule.attr].default) == rule.default
        assert rule.upstream.split(":")[0] in FINGERPRINTS and set(rule.sets.values()) <= set(rule.runs), rule.name


def test_lab_table_is_well_formed():
    from dsv4_lab.seams import LAB_KNOBS, LAB_SEAMS

    assert validate_table(LAB_SEAMS, lab_knobs=LAB_KNOBS) == []
    assert {s.overlay for s in LAB_SEAMS} == {"lab"}
    assert not {s.name for s in LAB_SEAMS} & {s.name for s in SEAMS}
    lab_only = Seam("z", "sglang.srt.entrypoints.engine:Engine.f", "around", "m:f", "r", "srt/entrypoints/engine.py:1",
                    ("DSV4_SM80_TRIPWIRE=1",))
    assert any("toggle 'DSV4_SM80_TRIPWIRE=1'" in p for p in validate_table([lab_only]))  # a product seam: no lab knob


def test_table_rejects_bad_entries():
    bad = Seam("x", "sglang.srt.entrypoints.engine:Engine.f", "wrap", "m:f", "", "srt/other.py:1", ("NOPE=1",))
    shared = Seam("y", "sglang.srt.entrypoints.engine:Engine.g", "replace", "m:f", "r", "srt/entrypoints/engine.py:1")
    problems = validate_table([bad, bad, shared, shared])
    for phrase in ("declared twice", "kind 'wrap'", "is not the target's file", "no 0.5.16 fingerprint",
                   "no reason", "toggle 'NOPE=1'", "replacement m:f is shared"):
        assert any(phrase in p for p in problems), (phrase, problems)


def test_declared_lines_hold_the_target(sglang_dir):
    """`upstream` file:line points at the definition it replaces, in the real 0.5.16 file (the lab's seams too)."""
    from dsv4_lab.seams import LAB_SEAMS

    for s in (*ALL, *LAB_SEAMS):
        path = os.path.join(sglang_dir, s.upstream_file)
        first = int(re.match(r"[^:]+:(\d+)", s.upstream).group(1))
        line = open(path, encoding="utf-8").read().splitlines()[first - 1]
        name = re.escape(s.attr_path[-1])
        assert re.search(rf"\b(def|class)\s+{name}\b|^\s*{name}\s*[:=]|^from \S+ import .*\b{name}\b"
                         rf"|^\s+(\w+ as )?{name},$", line), (s.name, line)


APPLY_ALL = """
import importlib, json, sys
from dsv4_sm80 import apply
from dsv4_sm80.seams import by_module
for name in by_module(apply.all_seams()):
    importlib.import_module(name)
marks = {}
for s in apply.all_seams():
    raw = apply.bound(s)
    # a value seam's mark is its value: the replacement applied to its own result changes nothing (one that
    # returns its input unchanged and acts by a side effect says itself whether that happened: .applied())
    # callables: the seam's mark is on its wrapper, somewhere along the chain (stages may stack)
    rep = apply._resolve(s.replacement)
    if s.kind == "value":
        marks[s.name] = s.name if (rep.applied() if hasattr(rep, "applied") else rep(raw) == raw) else None
    else:
        marks[s.name] = s.name if s.name in apply._marks(raw) else None
print(json.dumps({"status": apply.status(), "marks": marks}))
"""


def test_toggle_on_applies_every_seam_once(sglang_dir):
    # the vision seams apply only with DSV4_SM80_VISION=1 (vision.native_window only with the patch off: native
    # A/B); the lab's seams are not in this table (dsv4_lab/seams.py, tests/unit/test_product_isolation.py)
    out = last_json(run_python(APPLY_ALL, ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_VISION="1"))
    native_only = {"vision.native_window"}
    assert [(s["name"], s["state"], s["applied_count"]) for s in out["status"]] == \
           [(s.name, "off", 0) if s.name in native_only else (s.name, "applied", 1) for s in ALL]
    assert out["marks"] == {s.name: None if s.name in native_only else s.name for s in ALL}


def test_vision_overlay_alone_on_native_sglang(sglang_dir):
    """Patch off, DSV4_SM80_VISION=1: the vision overlay's seams (with the native image window, not the SM80 one)
    and nothing of the SM80 datapath, so the VL model can be compared on SGLang's own path."""
    out = last_json(run_python(APPLY_ALL, ENABLE_SGLANG_DSV4_A100_PATCH="0", DSV4_SM80_VISION="1"))
    vision = [s.name for s in VISION_SEAMS if s.name != "vision.sm80_window"]
    assert "vision.native_window" in vision and "vision.whole_image_blocks" in vision
    assert {s["name"]: s["state"] for s in out["status"]} == {
        s.name: ("applied" if s.name in vision else "off") for s in ALL}
    assert {k for k, v in out["marks"].items() if v} == set(vision)


def test_toggle_off_applies_none(sglang_dir):
    code = "import sys\npre = 'dsv4_sm80' in sys.modules\n" + APPLY_ALL.replace('"status"', '"pre": pre, "status"')
    out = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="0"))
    assert out["pre"] is False  # sitecustomize did not even import the patch body
    assert {s["state"] for s in out["status"]} == {"off"}
    assert set(out["marks"].values()) == {None}


def test_idempotent(sglang_dir):
    code = """
import importlib, json, sys
from dsv4_sm80 import apply
from dsv4_sm80.seams import SEAMS
import sglang.srt.entrypoints.engine as m
seam = next(s for s in SEAMS if s.name == "launch.gate")
again = apply.apply_seam(seam, m)
reinstalled = apply.install()
finders = sum(type(f).__name__ == "SeamFinder" for f in sys.meta_path)
importlib.reload(m)  # re-executes the module: the fresh original gets the seam once more
raw = vars(m.Engine)["_launch_subprocesses"].__func__
print(json.dumps({"again": again, "reinstalled": reinstalled, "finders": finders,
                  "count": apply.status()[0]["applied_count"], "chain": apply._marks(raw)}))
"""
    out = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    # one seam on SGLang's launch (the stages' server-argument rules are applied inside it)
    assert out == {"again": False, "reinstalled": True, "finders": 1, "count": 2, "chain": ["launch.gate"]}


def _farm(src: str, dst: str, changed_rel: str) -> str:
    """A copy of the real sglang package made of symlinks, except one file that gets a local edit."""
    parts = changed_rel.split("/")
    os.makedirs(dst)
    for i in range(len(parts)):
        here_src = os.path.join(src, *parts[:i])
        here_dst = os.path.join(dst, *parts[:i])
        for entry in os.listdir(here_src):
            if entry == parts[i] or os.path.exists(os.path.join(here_dst, entry)):
                continue
            os.symlink(os.path.join(here_src, entry), os.path.join(here_dst, entry))
        if i < len(parts) - 1:
            os.makedirs(os.path.join(here_dst, parts[i]))
    with open(os.path.join(src, changed_rel)) as f, open(os.path.join(dst, changed_rel), "w") as g:
        g.write(f.read() + "\n# a local edit\n")
    return dst


def test_changed_target_is_refused(sglang_dir, tmp_path):
    root = tmp_path / "site"
    _farm(sglang_dir, str(root / "sglang"), "srt/entrypoints/engine.py")
    code = """
import json
try:
    import sglang.srt.entrypoints.engine as m
    print(json.dumps({"imported": m.__file__}))
except BaseException as e:
    print(json.dumps({"refused": type(e).__name__, "msg": str(e)}))
"""
    out = last_json(run_python(code, pythonpath=(str(root),), ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    assert out["refused"] == "SeamRefusal"
    assert "seam launch.gate" in out["msg"] and "engine.py is not the 0.5.16 file" in out["msg"]
    assert "ENABLE_SGLANG_DSV4_A100_PATCH=0" in out["msg"]
    # native behaviour is untouched by the overlay when it is off
    out = last_json(run_python(code, pythonpath=(str(root),), ENABLE_SGLANG_DSV4_A100_PATCH="0"))
    assert out["imported"].startswith(str(root))
    # doctor's static preview reports the same
    gate_seam = SEAMS[0]
    assert target_state(str(root / "sglang"), gate_seam.upstream_file, gate_seam.attr_path) == \
        "srt/entrypoints/engine.py is not the 0.5.16 file"
    assert target_state(sglang_dir, gate_seam.upstream_file, gate_seam.attr_path) == "ok"
    assert target_state(sglang_dir, gate_seam.upstream_file, ("Engine", "nope")) == \
        "target Engine.nope not defined in srt/entrypoints/engine.py"


def test_missing_target_is_refused(sglang_dir):
    import sglang.srt.entrypoints.engine as m

    ghost = Seam("test.ghost", "sglang.srt.entrypoints.engine:Engine.no_such_method", "replace",
                 "dsv4_sm80.stages.launch:gate_and_set_args", "test", "srt/entrypoints/engine.py:1")
    with pytest.raises(apply.SeamRefusal, match=r"test.ghost: target .*no_such_method not found"):
        apply.apply_seam(ghost, m)
    assert not isinstance(apply.SeamRefusal("x"), Exception)  # survives SGLang's `except Exception`


def test_launch_gate_refuses_inside_sglang(sglang_dir, unit_ckpt):
    """With the patch on, SGLang's own launch runs the gate before any scheduler starts."""
    code = f"""
import json, sglang
try:
    sglang.Engine(model_path={unit_ckpt!r}, skip_tokenizer_init=True, device="cpu")
    print(json.dumps({{"started": True}}))
except Exception as e:
    print(json.dumps({{"refused": type(e).__name__, "msg": str(e)}}))
"""
    p = run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1")
    out = last_json(p)
    assert out["refused"] == "GateRefused", out
    assert "FAIL gpu.count: found 0 visible GPUs" in out["msg"]
    assert "dsv4-sm80 gate refused to launch SGLang" in p.stderr


def test_tripwire_is_off_by_default_and_raises_when_on(sglang_dir):
    """A lab seam: without the lab switch the tripwire knob alone changes nothing (its seams are not even in the
    status); with it, off by default and raising when on."""
    code = """
import json
import sglang.srt.layers.quantization.fp8_utils as f
from dsv4_sm80 import apply
out = {"states": sorted({s["state"] for s in apply.status() if s["name"].startswith("tripwire.")})}
try:
    f.deepgemm_w8a8_block_fp8_linear_with_fallback(None, None, None, None)
    out["call"] = "ran"
except BaseException as e:
    out["call"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""
    off = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_LAB="1"))
    assert off["states"] == ["off"] and not off["call"].startswith("TripwireError")
    assert last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_TRIPWIRE="1"))["states"] == []
    on = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_LAB="1", DSV4_SM80_TRIPWIRE="1"))
    assert "off" not in on["states"]  # applied, or pending until their module is imported
    assert on["call"].startswith("TripwireError: dsv4-sm80 tripwire: deepgemm_w8a8_block_fp8_linear_with_fallback "
                                 "was reached")


def test_tripwire_arms_every_deep_gemm_kernel(sglang_dir):
    """DeepGEMM as a whole: its kernel entry points raise with the tripwire on (the hc pre-norm GEMM a lab run
    once reached unwired among them), its host-side settings and torch-level helpers do not; off, nothing
    changes. The mHC seam routes SGLang's wrapper to the SM80 GEMM either way."""
    code = """
import json
import sglang.srt.layers.deep_gemm_wrapper.entrypoint as ep
import deep_gemm
out = {"wrapper": ep.tf32_hc_prenorm_gemm.__module__}
for name in ("tf32_hc_prenorm_gemm", "fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_einsum",
             "fp8_mega_moe", "get_num_sms", "per_token_cast_to_fp8"):
    out[name] = bool(getattr(getattr(deep_gemm, name), "dsv4_tripwire", False))
try:
    deep_gemm.tf32_hc_prenorm_gemm(None, None, None, None, num_splits=None)
except BaseException as e:
    out["call"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""
    pytest.importorskip("deep_gemm")
    proc = run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_LAB="1", DSV4_SM80_TRIPWIRE="1")
    on = last_json(proc)
    assert "DeepGEMM entry points armed" in proc.stderr and "tf32_hc_prenorm_gemm among them: True" in proc.stderr
    assert on["wrapper"] == "dsv4_sm80.stages.mhc", on
    assert [on[n] for n in ("tf32_hc_prenorm_gemm", "fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata",
                            "fp8_einsum", "fp8_mega_moe")] == [True] * 5, on
    assert not on["get_num_sms"] and not on["per_token_cast_to_fp8"], on
    assert on["call"].startswith("TripwireError: dsv4-sm80 tripwire: deep_gemm.tf32_hc_prenorm_gemm was reached"), on
    proc = run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1")
    off = last_json(proc)
    assert "armed" not in proc.stderr
    assert off["wrapper"] == "dsv4_sm80.stages.mhc" and not any(v is True for v in off.values()), off
    assert not off["call"].startswith("TripwireError"), off


def test_the_architecture_page_lists_every_seam_and_rule():
    """docs/architecture.md answers "where does the replacement for X live": a row per seam, each rule named."""
    from conftest import REPO

    page = open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8").read()
    for s in ALL:
        file = s.replacement.split(":")[0].replace(".", "/") + ".py"
        assert f"| `{s.name}` ({s.kind}) | `{file}`: `{s.replacement.split(':')[1]}` |" in page, s.name
    assert all(f"`{r.name}`" in page for r in SERVER_ARGS)
