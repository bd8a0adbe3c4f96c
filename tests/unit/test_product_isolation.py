"""The product never reaches the laboratory: importing every product module and applying every product seam
(against the real sglang==0.5.16, as tests/unit/test_seams.py does) imports no `dsv4_lab` module; the only import of
it in product code is the applier's, behind the lab switch; with DSV4_SM80_LAB=1 the lab's seams are applied
after the product's on every shared target, and a missing lab package is a clear error."""

import ast
import glob
import os
import sys

import pytest

from conftest import REPO, last_json, run_python

PRODUCT_FILES = sorted(glob.glob(os.path.join(REPO, "dsv4_sm80", "**", "*.py"), recursive=True)
                       + glob.glob(os.path.join(REPO, "vision_backport", "*.py"))
                       + [os.path.join(REPO, "sitecustomize.py"), os.path.join(REPO, "compat_check.py")])

IMPORT_ALL = """
import importlib, json, pkgutil, sys
import dsv4_sm80, vision_backport
names = [m.name for pkg in (dsv4_sm80, vision_backport)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".") if not m.name.endswith("__main__")]
for name in names + ["compat_check"]:
    importlib.import_module(name)
from dsv4_sm80 import apply
from dsv4_sm80.seams import by_module
for name in by_module(apply.all_seams()):
    importlib.import_module(name)
chains = {}
for s in apply.all_seams():
    chains[s.target] = apply._marks(apply.bound(s))
print(json.dumps({"imported": len(names), "lab": sorted(m for m in sys.modules if m.split(".")[0] == "dsv4_lab"),
                  "status": {s["name"]: s["state"] for s in apply.status()}, "chains": chains}))
"""

ON = dict(ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_VISION="1")


def test_product_code_imports_the_lab_only_in_the_applier_behind_the_switch():
    found = []
    for path in PRODUCT_FILES:
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(os.path.relpath(path, REPO), n) for n in names if n.split(".")[0] == "dsv4_lab"]
    assert found == [("dsv4_sm80/apply.py", "dsv4_lab.seams")], found


@pytest.mark.sglang
def test_every_product_module_and_seam_without_the_lab():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; the seams need the real one")
    out = last_json(run_python(IMPORT_ALL, **ON))
    assert out["imported"] > 30 and out["lab"] == [], out["lab"]
    assert out["status"]["vision.sm80_window"] == "applied" and out["status"]["vision.native_window"] == "off"
    assert not any(name.startswith(("lab.", "tripwire.")) for name in out["status"])
    assert {state for name, state in out["status"].items() if name != "vision.native_window"} == {"applied"}


@pytest.mark.sglang
def test_lab_seams_apply_after_the_product_seams():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; the seams need the real one")
    from dsv4_lab.mutants import MUTANT_SEAMS
    from dsv4_lab.seams import LAB_SEAMS
    from dsv4_sm80.seams import SEAMS

    out = last_json(run_python(IMPORT_ALL, DSV4_SM80_LAB="1", DSV4_SM80_TRIPWIRE="1", DSV4_SM80_LAB_POISON="1",
                               DSV4_SM80_LAB_MUTANT="runtime", **ON))
    # the run-time mutants are all wrapped; a load-time mutant only when DSV4_SM80_LAB_MUTANT names it
    load_time = {s.name for s in MUTANT_SEAMS if "|runtime" not in s.when[0]}
    applied = {n for n, st in out["status"].items() if st == "applied"}
    assert {s.name for s in LAB_SEAMS} - load_time <= applied
    assert {out["status"][n] for n in load_time} == {"off"}
    product = {s.name for s in SEAMS}
    shared = 0
    for lab in (s for s in LAB_SEAMS if s.kind != "value" and s.name not in load_time):  # a value seam: no mark
        chain = out["chains"][lab.target]  # the wrappers' marks, outermost first
        at = chain.index(lab.name)
        assert not any(m in product for m in chain[:at]), (lab.name, chain)
        shared += any(m in product for m in chain[at + 1:])
    assert shared >= 3  # mutants over the product's attention forward and indexer top-k, the memory log


def test_lab_switch_without_the_lab_package_is_a_clear_error(monkeypatch):
    from dsv4_sm80 import apply

    assert apply.lab_seams({"DSV4_SM80_LAB": "0"}) == ()
    monkeypatch.setitem(sys.modules, "dsv4_lab.seams", None)  # as if dsv4_lab were not on the path
    with pytest.raises(apply.LabMissing, match="DSV4_SM80_LAB=1 but the lab package cannot be imported.*unset "
                                               "DSV4_SM80_LAB"):
        apply.lab_seams({"DSV4_SM80_LAB": "1"})
