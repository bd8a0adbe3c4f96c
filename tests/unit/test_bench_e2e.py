"""bench/e2e.py's CPU-side parts: each mode's environment, the kernel-time reader of a profiler trace, the
per-step table, and its profiler call's keywords against SGLang 0.5.16's own ProfileReq."""

import ast
import gzip
import importlib.util
import json
import os

import pytest

from conftest import REPO

PATH = os.path.join(REPO, "bench", "e2e.py")
spec = importlib.util.spec_from_file_location("bench_e2e", PATH)
e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(e2e)


def test_each_mode_switches_one_stage_and_native_turns_the_patch_off():
    base = {"DSV4_SM80_LAB_GPU_COUNT": "8", "SGLANG_DSV4_MXFP4_MOE_BACKEND": "inherited"}
    nat = e2e.mode_env("native", 1, base)
    assert nat["ENABLE_SGLANG_DSV4_A100_PATCH"] == "0"
    pat = e2e.mode_env("patched", 1, base)
    assert pat["ENABLE_SGLANG_DSV4_A100_PATCH"] == pat["DSV4_SM80_TRIPWIRE"] == pat["DSV4_SM80_LAB"] == "1"
    assert pat["DSV4_SM80_LAB_GPU_COUNT"] == "1"  # --tp wins over an inherited override
    assert "DSV4_SM80_LAB_GPU_COUNT" not in e2e.mode_env("patched", 4, base)  # the gate's production count
    assert e2e.mode_env("patched-marlin", 1, {})["SGLANG_DSV4_MXFP4_MOE_BACKEND"] == "marlin"
    assert e2e.mode_env("patched-fp8", 1, {})["SGLANG_DSV4_A100_DENSE"] == "fp8_marlin"
    assert REPO in e2e.mode_env("patched", 1, {})["PYTHONPATH"].split(os.pathsep)
    assert pat["DSV4_SM80_LAB_CC"] == "9.0"  # an H200 (or cc unknown): the lab's override of the gate
    a800 = e2e.mode_env("patched", 4, {}, cc="8.0")
    assert "DSV4_SM80_LAB_CC" not in a800 and a800["ENABLE_SGLANG_DSV4_A100_PATCH"] == "1"  # the gate's own GPU
    assert e2e.mode_env("patched", 4, {}, cc="9.0")["DSV4_SM80_LAB_CC"] == "9.0"
    with pytest.raises(SystemExit, match="unknown mode 'bogus'"):
        e2e.mode_env("bogus", 1, {})


def test_kernel_times_sum_kernel_events_only(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm_a", "dur": 10.0},
        {"ph": "X", "cat": "kernel", "name": "gemm_a", "dur": 5.5},
        {"ph": "X", "cat": "kernel", "name": "moe_b", "dur": 20.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 99.0},  # host side: not GPU time
        {"ph": "i", "cat": "kernel", "name": "marker"},
    ]
    plain = tmp_path / "a-DECODE.trace.json"
    plain.write_text(json.dumps({"traceEvents": events}))
    packed = tmp_path / "b-DECODE.trace.json.gz"
    with gzip.open(packed, "wt") as f:
        json.dump({"traceEvents": events[:1]}, f)
    t = e2e.kernel_times([str(plain), str(packed)])
    assert t == {"gemm_a": 25.5, "moe_b": 20.0}


def test_profile_table_per_step_and_against_native():
    lines = e2e.profile_table({"native": {"k1": 300.0, "k2": 100.0}, "patched": {"k3": 600.0}}, steps=4)
    assert lines[0] == "native: 100.0 us of kernels per decode step"
    assert "75.0 us" in lines[1] and "k1" in lines[1] and " 75.0 %" in lines[1]
    assert lines[3] == "patched: 150.0 us of kernels per decode step (1.50x native)"


@pytest.mark.sglang
def test_start_profile_keywords_are_profilereq_fields():
    """A misspelt keyword would only fail on the GPU, after both engines' start."""
    from sglang.srt.managers.io_struct import ProfileReq

    tree = ast.parse(open(PATH).read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "start_profile"]
    assert calls, "bench/e2e.py no longer calls engine.start_profile"
    fields = set(ProfileReq.__struct_fields__)
    for c in calls:
        kws = {k.arg for k in c.keywords}
        assert kws <= fields, kws - fields
        assert "profile_by_stage" in kws  # the stage trigger is what stops the profiler by itself


def test_step_bytes_from_the_checkpoint_arithmetic():
    """The full-width checkpoint (make-tiny --preset wide) at TP1: the BF16 dense path reads more per step than native's
    FP8, the routed experts' share grows with the batch as E * (1 - (1 - k/E)^b) of E, and FP8-Marlin sits between."""
    from dsv4_sm80.footprint import weights
    from dsv4_sm80.tiny.generate import PRESETS, tiny_config

    cfg = tiny_config(PRESETS["wide"])
    w_nat, w_bf = weights(cfg, tp=1, dense="native")["main"], weights(cfg, tp=1, dense="bf16")["main"]
    b1 = {m: e2e.step_bytes(cfg, 1, m, 1) for m in e2e.DENSE_OF_MODE}
    b16 = {m: e2e.step_bytes(cfg, 1, m, 16) for m in e2e.DENSE_OF_MODE}
    assert b1["native"] < b1["patched-fp8"] < b1["patched"] == b1["patched-marlin"]
    experts = w_bf["experts"]
    assert w_nat["experts"] == experts  # MXFP4 either way
    assert abs((b16["patched"] - b1["patched"]) - experts * ((1 - (250 / 256) ** 16) - 6 / 256)
               - 15 * 4096 * 2) < 1.0
    assert 80 < 256 * (1 - (250 / 256) ** 16) < 81  # ~80 experts of each layer at batch 16 (docs/results/README.md)
    assert 5e9 < b16["patched"] < 8e9  # the wide model's step at batch 16: ~6.6 GB


def test_exit_status_counts_modes_only():
    rows = {"rows": [{}]}
    assert e2e.measured_all({"native": rows, "patched": rows, "profile": {"native": {}}}, ["native", "patched"])
    assert not e2e.measured_all({"native": rows, "patched": {"error": "timeout"}}, ["native", "patched"])
    assert not e2e.measured_all({"native": rows}, ["native", "patched"])


def test_profile_report_per_batch_from_the_trace_folders(tmp_path):
    def trace(path, kernels):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        events = [{"cat": "kernel", "ph": "X", "name": n, "dur": d} for n, d in kernels]
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events}, f)

    trace(str(tmp_path / "native" / "b1" / "1-TP-0-DECODE.trace.json.gz"), [("k1", 40.0), ("k1", 40.0)])
    trace(str(tmp_path / "patched" / "b1" / "1-TP-0-DECODE.trace.json.gz"), [("k2", 100.0)])
    trace(str(tmp_path / "native" / "b16" / "1-TP-0-DECODE.trace.json.gz"), [("k1", 300.0)])
    results = {"patched": {"rows": [], "profile_errors": {"16": "RuntimeError: busy"}}}
    lines, record = e2e.profile_report(str(tmp_path), ["native", "patched"], [1, 16], 4, results)
    text = "\n".join(lines)
    assert "kernels per decode step (batch 1," in text and "kernels per decode step (batch 16," in text
    assert "patched: 25.0 us of kernels per decode step (1.25x native)" in text  # 100 / 4 against 80 / 4
    assert "e2e patched: no profile trace at batch 16 RuntimeError: busy" in text
    assert record[1] == {"native": {"k1": 80.0}, "patched": {"k2": 100.0}} and record[16] == {"native": {"k1": 300.0}}
