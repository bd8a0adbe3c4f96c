"""The env contract (dsv4_sm80.env)."""

import pytest

from dsv4_sm80 import env


def test_defaults_and_choices():
    assert env.get(env.PATCH, {}) == "0" and env.patch_enabled({}) is False
    assert env.patch_enabled({"ENABLE_SGLANG_DSV4_A100_PATCH": "1"}) is True
    assert env.get(env.MOE_BACKEND, {}) == "mxfp4_int8"
    assert env.get(env.INT8_INDEXER, {}) == "1"
    assert env.get(env.MOE_BACKEND, {"SGLANG_DSV4_MXFP4_MOE_BACKEND": "marlin"}) == "marlin"
    with pytest.raises(env.EnvError, match="SGLANG_DSV4_MXFP4_MOE_BACKEND='int4' is not one of mxfp4_int8, marlin"):
        env.get(env.MOE_BACKEND, {"SGLANG_DSV4_MXFP4_MOE_BACKEND": "int4"})


@pytest.mark.parametrize("knob, default, other, bad", [
    (env.KV_ROUNDING, "none", "fp8_sim", "fp8"),
    (env.INDEXER_ROUNDING, "int8", "fp4_sim", "fp4"),
])
def test_rounding_knobs(knob, default, other, bad):
    assert knob in env.KNOBS and env.get(knob, {}) == default and env.get(knob, {knob.name: other}) == other
    with pytest.raises(env.EnvError, match=f"{knob.name}='{bad}' is not one of {default}, {other}"):
        env.get(knob, {knob.name: bad})


def test_import_time_defaults_only_where_unset():
    environ = {"SGLANG_OPT_USE_TOPK_V2": "1"}
    applied = env.apply_import_time_defaults(environ)
    assert "SGLANG_OPT_USE_TOPK_V2" not in applied and environ["SGLANG_OPT_USE_TOPK_V2"] == "1"
    assert environ["SGLANG_OPT_FP8_WO_A_GEMM"] == "0" and applied["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
    assert all(d.reason and d.name.startswith("SGLANG_") for d in env.IMPORT_TIME_DEFAULTS)


def test_lab_overrides():
    given = {"DSV4_SM80_LAB_CC": " ", "DSV4_SM80_LAB_GPU_COUNT": "2"}
    assert env.lab_overrides(given) == {"DSV4_SM80_LAB_GPU_COUNT": "2"}


def test_the_lab_is_one_switch_in_the_product_contract():
    """The product's contract names the lab switch and the gate's two lab overrides, no other lab knob (those
    are dsv4_lab/knobs.py's)."""
    assert env.lab_enabled({}) is False and env.lab_enabled({"DSV4_SM80_LAB": "1"}) is True
    with pytest.raises(env.EnvError, match="DSV4_SM80_LAB='yes' is not one of 0, 1"):
        env.lab_enabled({"DSV4_SM80_LAB": "yes"})
    lab_named = {k.name for k in env.KNOBS if "LAB" in k.name or "TRIPWIRE" in k.name}
    assert lab_named == {"DSV4_SM80_LAB", "DSV4_SM80_LAB_GPU_COUNT", "DSV4_SM80_LAB_CC"}
    from dsv4_lab.knobs import LAB_KNOBS

    assert not {k.name for k in LAB_KNOBS} & {k.name for k in env.KNOBS}


GUARDS = """
import json, os
for k in [k for k in os.environ if k.startswith("SGLANG_")]:
    del os.environ[k]
from sglang.srt.environ import envs
from dsv4_sm80.env import IMPORT_TIME_DEFAULTS
out = {}
for d in IMPORT_TIME_DEFAULTS:
    v = getattr(envs, d.name).get()
    out[d.name] = [str(int(v)) if isinstance(v, bool) else str(v), d.value, d.guard]
print(json.dumps(out))
"""


def test_guards_are_sglang_defaults_and_pins_are_not():
    """A pin marked guard holds SGLang 0.5.16's own default (native runs the same with it, so the native pin
    sweeps leave it out); every other pin changes SGLang's default."""
    pytest.importorskip("sglang")
    from conftest import last_json, run_python

    out = last_json(run_python(GUARDS))
    assert set(out) == {d.name for d in env.IMPORT_TIME_DEFAULTS}
    for name, (sglang_default, value, guard) in out.items():
        assert (sglang_default == value) == guard, (name, sglang_default, value, guard)


def test_the_lab_switch_alone_prints_the_lab_banner():
    banner = env.lab_banner({"DSV4_SM80_LAB": "1"})
    assert "LAB MODE: DSV4_SM80_LAB=1" in banner and "lab's seams are applied" in banner
    assert env.lab_banner({"DSV4_SM80_LAB": "0"}) is None and env.lab_banner({}) is None
