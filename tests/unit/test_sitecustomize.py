"""The injection contract: what `sitecustomize` does at interpreter start, with the toggle at 0 and 1."""

import os
import shutil

from conftest import REPO, last_json, run_python

STATE = """
import json, os, sys
sc = sys.modules.get("sitecustomize")
finders = [type(f).__name__ for f in sys.meta_path]
print(json.dumps({
    "state": getattr(sc, "DSV4_SM80_STATE", "absent"), "chained": getattr(sc, "CHAINED", None),
    "dsv4_imported": "dsv4_sm80" in sys.modules, "torch": "torch" in sys.modules,
    "sglang": "sglang" in sys.modules, "seam_finder": "SeamFinder" in finders,
    "opt": {k: os.environ.get(k) for k in ("SGLANG_OPT_USE_TOPK_V2", "SGLANG_OPT_FP8_WO_A_GEMM")},
    "chained_ran": os.environ.get("CHAINED_RAN"),
}))
"""


def test_off_does_nothing_at_all():
    for value in (None, "0", ""):
        s = last_json(run_python(STATE, ENABLE_SGLANG_DSV4_A100_PATCH=value))
        assert s["state"] is None and not s["dsv4_imported"] and not s["seam_finder"], s
        assert s["opt"] == {"SGLANG_OPT_USE_TOPK_V2": None, "SGLANG_OPT_FP8_WO_A_GEMM": None}


def test_on_installs_lazily_without_torch_or_sglang():
    s = last_json(run_python(STATE, ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    assert s["seam_finder"] and s["state"]["installed"] and s["state"]["error"] is None
    assert not s["torch"] and not s["sglang"]  # no CUDA initialisation before SGLang spawns
    assert s["opt"] == {"SGLANG_OPT_USE_TOPK_V2": "0", "SGLANG_OPT_FP8_WO_A_GEMM": "0"}


def test_user_knobs_win():
    s = last_json(run_python(STATE, ENABLE_SGLANG_DSV4_A100_PATCH="1", SGLANG_OPT_USE_TOPK_V2="1"))
    assert s["opt"]["SGLANG_OPT_USE_TOPK_V2"] == "1"
    assert "SGLANG_OPT_USE_TOPK_V2" not in s["state"]["defaults_set"]


def test_invalid_toggle_is_loud_and_installs_nothing():
    p = run_python(STATE, ENABLE_SGLANG_DSV4_A100_PATCH="true")
    s = last_json(p)
    assert not s["seam_finder"] and "is not one of 0, 1" in s["state"]["error"]
    assert "dsv4-sm80: refusing to patch: ENABLE_SGLANG_DSV4_A100_PATCH='true'" in p.stderr


def test_chains_to_the_next_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED_RAN'] = 'yes'\n")
    # a second copy of ours further down the path (e.g. an installed one) is not run twice
    ours = tmp_path / "ours"
    ours.mkdir()
    shutil.copy(os.path.join(REPO, "sitecustomize.py"), ours / "sitecustomize.py")
    for value in ("0", "1"):
        s = last_json(run_python(STATE, pythonpath=(REPO, str(ours), str(other)), ENABLE_SGLANG_DSV4_A100_PATCH=value))
        assert s["chained_ran"] == "yes" and s["chained"] == str(other / "sitecustomize.py"), s


def test_broken_patch_body_is_loud(tmp_path):
    (tmp_path / "dsv4_sm80").mkdir()
    (tmp_path / "dsv4_sm80" / "__init__.py").write_text("raise ImportError('patch body damaged')\n")
    shutil.copy(os.path.join(REPO, "sitecustomize.py"), tmp_path / "sitecustomize.py")
    p = run_python(STATE.replace('"dsv4_imported": "dsv4_sm80" in sys.modules', '"dsv4_imported": None'),
                   pythonpath=(str(tmp_path),), ENABLE_SGLANG_DSV4_A100_PATCH="1")
    s = last_json(p)
    assert s["state"]["installed"] is False and "patch body damaged" in s["state"]["error"]
    assert "the overlay cannot be imported" in p.stderr and "SGLang will run unpatched" in p.stderr


def test_spawned_children_get_the_patch():
    """SGLang starts its schedulers with the spawn method: each child runs sitecustomize again."""
    code = """
import json, multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from dsv4_sm80 import apply
with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
    print(json.dumps(ex.submit(apply.installed).result()))
"""
    assert last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1")) is True
    assert last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="0")) is False
