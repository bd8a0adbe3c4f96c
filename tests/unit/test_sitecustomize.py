"""The injection contract: what `sitecustomize` does at interpreter start, with the toggle at 0 and 1, and that a
switch it cannot honour refuses every SGLang launch instead of letting SGLang run unpatched."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, last_json, run_python

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


def test_a_value_outside_its_column_installs_nothing_and_other_python_runs():
    for knobs in ({"ENABLE_SGLANG_DSV4_A100_PATCH": "true"}, {"DSV4_SM80_VISION": "yes"},
                  {"ENABLE_SGLANG_DSV4_A100_PATCH": "1", "SGLANG_DSV4_MXFP4_MOE_BACKEND": "int4"}):
        p = run_python(STATE, **knobs)
        s = last_json(p)
        assert not s["seam_finder"] and not s["state"]["installed"] and not s["state"]["defaults_set"], knobs
        name = next(k for k in knobs if knobs[k] in ("true", "yes", "int4"))
        assert s["state"]["refusal"].startswith(f"dsv4-sm80 refuses to launch SGLang: FAIL env.knobs: found {name}=")
        assert p.stderr == "" and s["opt"]["SGLANG_OPT_USE_TOPK_V2"] is None  # nothing said or set before a launch


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
    assert s["state"]["refusal"].startswith("dsv4-sm80 refuses to launch SGLang: ENABLE_SGLANG_DSV4_A100_PATCH=1 but "
                                            "the overlay cannot be imported (ImportError: patch body damaged)")
    assert p.stderr == ""


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


def launch_server(*args, pythonpath=(), **knobs):
    env = clean_env(**knobs)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, REPO])
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


LAUNCHES = """
import json, sys
import sglang  # importing SGLang is no launch
out = {"imported": True}
try:
    sglang.Engine(model_path="/no/such/model", device="cpu")
    out["engine"] = "started"
except SystemExit as e:
    out["engine"] = [type(e).__name__, str(e)]
try:
    import sglang.srt.managers.scheduler  # what each spawned scheduler process imports first
    out["scheduler"] = "imported"
except SystemExit as e:
    out["scheduler"] = type(e).__name__
sys.argv = ["sglang", "serve", "--model-path", "/no/such/model"]
try:
    from sglang.cli.main import main
    main()
except SystemExit as e:
    out["serve"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_a_bad_switch_refuses_every_sglang_launch(tmp_path):
    """A switch value outside its column: `python -m sglang.launch_server` refuses with one line naming the
    variable, before SGLang parses its arguments (the bogus flag is never reported) or loads anything; so do
    sglang.Engine, `sglang serve` and a scheduler process's import, while `import sglang` still works."""
    pytest.importorskip("sglang")
    p = launch_server("--model-path", "/no/such/model", "--no-such-flag", ENABLE_SGLANG_DSV4_A100_PATCH="yes")
    line = ("dsv4-sm80 refuses to launch SGLang: FAIL env.knobs: found ENABLE_SGLANG_DSV4_A100_PATCH='yes'; "
            "expected one of 0, 1")
    assert p.returncode == 1 and p.stderr.strip().startswith(line), p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and "no-such-flag" not in p.stderr
    out = last_json(run_python(LAUNCHES, ENABLE_SGLANG_DSV4_A100_PATCH="yes"))
    assert out["imported"] and out["engine"][0] == "LaunchRefused" and out["engine"][1].startswith(line), out
    assert out["scheduler"] == "LaunchRefused" and out["serve"].startswith(line), out
    p = launch_server("--model-path", "/no/such/model", DSV4_SM80_VISION="on")
    assert p.returncode == 1 and "FAIL env.knobs: found DSV4_SM80_VISION='on'" in p.stderr


@pytest.mark.sglang
def test_the_switch_on_without_the_overlay_refuses_every_sglang_launch(tmp_path):
    pytest.importorskip("sglang")
    (tmp_path / "dsv4_sm80").mkdir()
    (tmp_path / "dsv4_sm80" / "__init__.py").write_text("raise ImportError('patch body damaged')\n")
    shutil.copy(os.path.join(REPO, "sitecustomize.py"), tmp_path / "sitecustomize.py")
    p = launch_server("--model-path", "/no/such/model", "--no-such-flag", pythonpath=(str(tmp_path),),
                      ENABLE_SGLANG_DSV4_A100_PATCH="1")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
    assert p.stderr.startswith("dsv4-sm80 refuses to launch SGLang: ENABLE_SGLANG_DSV4_A100_PATCH=1 but the overlay "
                               "cannot be imported (ImportError: patch body damaged)")
    out = last_json(run_python(LAUNCHES, pythonpath=(str(tmp_path),), ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    assert out["engine"][0] == "LaunchRefused" and out["scheduler"] == "LaunchRefused", out
