"""JIT caches: the gate's jit.cache check (injected facts and real probes) and the launch.jit_disk_full seam
around SGLang 0.5.16's own load_jit (applied in a fresh interpreter, the build made to hit ENOSPC)."""

import errno
import json
import os
import re

import pytest
from test_gate import facts, failed

import compat_check as cc
from conftest import REPO, last_json, run_python
from dsv4_sm80 import jitcache


def cache(label="Triton (TRITON_CACHE_DIR)", path="/root/.triton/cache", **kw):
    return jitcache.CacheDirFacts(**{"label": label, "path": path, "exists": True, "anchor": path,
                                     "writable": True, "free_bytes": 50 << 30, **kw})


def with_jit(dirs):
    f = facts()
    f.jit = dirs
    return f


def test_good_caches_pass_and_uncollected_is_a_skip():
    found = {x.check: x for x in cc.evaluate(with_jit([cache(), cache("TileLang (TILELANG_CACHE_DIR)", "/t")]))}
    assert found["jit.cache"].status == "pass" and "2 cache directories writable" in found["jit.cache"].found
    assert {x.check: x.status for x in cc.evaluate(facts())}["jit.cache"] == "skip"


def test_a_cold_triton_cache_is_said_not_refused(tmp_path):
    """The pass line says when this path's Triton kernels were never built in the cache (a first start compiles
    them under SGLang's watchdog); a cache holding one of them is warm. Read from the directory layout Triton
    writes: one directory per build with `<kernel>.json` in it."""
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "_some_other_kernel.json").write_text("{}")
    assert not jitcache.ours_built(str(tmp_path)) and not jitcache.ours_built(str(tmp_path / "missing"))
    cold = {x.check: x for x in cc.evaluate(with_jit([cache(ours_built=False)]))}["jit.cache"]
    assert cold.status == "pass" and "not built here yet" in cold.found and "--watchdog-timeout" in cold.found
    (tmp_path / "def").mkdir()
    (tmp_path / "def" / "_w4a8_moe_kernel.json").write_text("{}")
    assert jitcache.ours_built(str(tmp_path))
    warm = {x.check: x for x in cc.evaluate(with_jit([cache(ours_built=True)]))}["jit.cache"]
    assert "not built" not in warm.found
    got = jitcache.facts({"TRITON_CACHE_DIR": str(tmp_path), "TVM_FFI_CACHE_DIR": str(tmp_path / "t"),
                          "TILELANG_CACHE_DIR": str(tmp_path / "l")})
    assert [f.ours_built for f in got] == [True, None, None]


def test_full_disk_refused_naming_the_directory_and_the_variable():
    bad = failed(with_jit([cache(free_bytes=200 << 20)]))
    assert list(bad) == ["jit.cache"]
    line = bad["jit.cache"].line()
    for phrase in ("/root/.triton/cache", "0.20 GiB free", ">= 1.00 GiB", "TRITON_CACHE_DIR"):
        assert phrase in line, line


def test_unwritable_cache_refused():
    bad = failed(with_jit([cache("SGLang JIT / tvm-ffi (TVM_FFI_CACHE_DIR)", "/ro/tvm", writable=False,
                                 error="OSError: [Errno 30] Read-only file system")]))
    line = bad["jit.cache"].line()
    assert "Read-only file system" in line and "TVM_FFI_CACHE_DIR" in line and "/ro/tvm" in line


def test_probe_real_directories(tmp_path):
    there = jitcache.probe("x", str(tmp_path))
    assert there.exists and there.writable and there.free_bytes > 0 and there.error is None
    later = jitcache.probe("x", str(tmp_path / "a" / "b"))  # created on first use, under tmp_path
    assert not later.exists and later.writable and later.anchor == str(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    blocked = jitcache.probe("x", str(blocker / "cache"))  # a file where a directory must go
    assert not blocked.writable and "not a directory" in blocked.error
    assert list(os.listdir(tmp_path)) == ["file"]  # the probe leaves nothing behind


def test_cache_dirs_follow_the_tools_variables(tmp_path):
    dirs = jitcache.cache_dirs({"TRITON_CACHE_DIR": "/a", "TVM_FFI_CACHE_DIR": "/b", "TILELANG_CACHE_DIR": "/c"})
    assert sorted(dirs.values()) == ["/a", "/b", "/c"]
    dirs = jitcache.cache_dirs({"TRITON_HOME": "/h"})
    assert "/h/.triton/cache" in dirs.values()
    real = cc.collect().jit
    assert len(real) == 3 and all(d.free_bytes for d in real)


def _raise(exc):
    def original(*args, **kwargs):
        raise exc
    return original


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"),
                                 RuntimeError("ninja: build stopped: subcommand failed.\n/usr/bin/ld: final "
                                              "link failed: No space left on device")])
def test_disk_full_build_becomes_a_clear_error(exc, tmp_path):
    from dsv4_sm80.stages.launch import load_jit_naming_a_full_disk

    with pytest.raises(jitcache.JitCacheFull) as e:
        load_jit_naming_a_full_disk(_raise(exc), "dsv4", "rope", build_directory=str(tmp_path / "m"))
    msg = str(e.value)
    assert "jit.disk_full" in msg and "'dsv4_rope'" in msg and str(tmp_path / "m") in msg
    assert "GiB free" in msg and "TVM_FFI_CACHE_DIR" in msg and e.value.__cause__ is exc


def test_other_build_errors_pass_through_unchanged():
    from dsv4_sm80.stages.launch import load_jit_naming_a_full_disk

    err = RuntimeError("nvcc: error: identifier foo is undefined")
    with pytest.raises(RuntimeError) as e:
        load_jit_naming_a_full_disk(_raise(err), "m")
    assert e.value is err
    assert load_jit_naming_a_full_disk(lambda *a, **k: ("ok", a, k), "m", x=1) == ("ok", ("m",), {"x": 1})


SEAM_IN_SGLANG = r"""
import errno, json, tvm_ffi.cpp
def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
tvm_ffi.cpp.load_inline = tvm_ffi.cpp.load = full
from sglang.jit_kernel.utils import load_jit  # the re-exported copy SGLang's kernels import
try:
    load_jit("dsv4_probe", cuda_files=[], cuda_wrappers=[("f", "g")])
    out = "built?"
except BaseException as e:
    out = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_seam_wraps_sglangs_load_jit(tmp_path):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; the seam test needs the real one")
    on = last_json(run_python(SEAM_IN_SGLANG, ENABLE_SGLANG_DSV4_A100_PATCH="1", TVM_FFI_CACHE_DIR=str(tmp_path)))
    assert on.startswith("JitCacheFull: dsv4-sm80 jit.disk_full") and "sgl_kernel_jit_dsv4_probe" not in on
    assert "'dsv4_probe'" in on and str(tmp_path) in on
    off = last_json(run_python(SEAM_IN_SGLANG, ENABLE_SGLANG_DSV4_A100_PATCH="0", TVM_FFI_CACHE_DIR=str(tmp_path)))
    assert off.startswith("OSError: [Errno 28]")



def test_caches_resolved_in_the_launch_environment(tmp_path):
    """serve runs the gate with the environment it will launch in: its cache variables count, not ours."""
    f = cc.collect(patch_environ={"TRITON_CACHE_DIR": str(tmp_path / "t"), "TVM_FFI_CACHE_DIR": str(tmp_path)})
    assert {d.path for d in f.jit} >= {str(tmp_path / "t"), str(tmp_path)}


TRITON_FULL = r"""
import errno, json, os
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4_sm80.kernels import indexer_int8 as ix

def full(src, dst):  # every atomic rename into the cache fails as on a full disk
    raise OSError(errno.ENOSPC, "No space left on device")
os.replace = full
try:
    triton.compile(ASTSource(fn=ix._store_index_k_kernel, signature={"x_ptr": "*fp32", "stride_x": "i32",
                   "loc_ptr": "*i32", "cache_ptr": "*i8", "cache_f32_ptr": "*fp32"}, constexprs={}),
                   target=GPUTarget("cuda", 80, 32), options={"num_warps": 4})
    out = "compiled?"
except BaseException as e:
    out = f"{type(e).__name__}: {e}"
print(json.dumps({"out": out, "manager": os.environ.get("TRITON_CACHE_MANAGER")}))
"""


def test_triton_cache_write_on_a_full_disk_is_named(tmp_path):
    """A Triton kernel (ours, compiled for sm_80) whose cache write fails for lack of space: with the patch on
    the bootstrap's cache class (Triton's TRITON_CACHE_MANAGER hook) names jit.disk_full, the file, the
    directory and the fix; off, Triton's bare OSError. A user's own cache class is left alone."""
    on = last_json(run_python(TRITON_FULL, TRITON_INTERPRET="0", ENABLE_SGLANG_DSV4_A100_PATCH="1",
                              TRITON_CACHE_DIR=str(tmp_path / "on")))
    assert on["manager"] == jitcache.TRITON_CACHE_MANAGER
    assert on["out"].startswith("JitCacheFull: dsv4-sm80 jit.disk_full: writing Triton kernel file"), on
    assert str(tmp_path / "on") in on["out"] and "TRITON_CACHE_DIR" in on["out"] and "GiB free" in on["out"]
    off = last_json(run_python(TRITON_FULL, TRITON_INTERPRET="0", ENABLE_SGLANG_DSV4_A100_PATCH="0",
                               TRITON_CACHE_DIR=str(tmp_path / "off")))
    assert off["manager"] is None and off["out"].startswith("OSError: [Errno 28]"), off
    mine = "triton.runtime.cache:FileCacheManager"
    user = last_json(run_python(TRITON_FULL, TRITON_INTERPRET="0", ENABLE_SGLANG_DSV4_A100_PATCH="1",
                                TRITON_CACHE_MANAGER=mine, TRITON_CACHE_DIR=str(tmp_path / "user")))
    assert user["manager"] == mine and user["out"].startswith("OSError: [Errno 28]"), user


def with_nvcc(n):
    f = facts()
    f.nvcc = n
    return f


def test_jit_compiler_check():
    ok = jitcache.NvccFacts(path="/usr/local/cuda/bin/nvcc", how="PATH", version="12.8")
    found = {x.check: x for x in cc.evaluate(with_nvcc(ok))}["jit.compiler"]
    assert found.status == "pass" and "nvcc 12.8 at /usr/local/cuda/bin/nvcc" in found.found
    assert {x.check: x.status for x in cc.evaluate(facts())}["jit.compiler"] == "skip"
    missing = jitcache.NvccFacts(how="/usr/local/cuda (CUDA_HOME unset, no nvcc on PATH)",
                                 error="no nvcc at /usr/local/cuda/bin/nvcc")
    line = failed(with_nvcc(missing))["jit.compiler"].line()
    assert line.startswith("FAIL jit.compiler: found no nvcc at /usr/local/cuda/bin/nvcc (looked up via "
                           "/usr/local/cuda (CUDA_HOME unset, no nvcc on PATH)); expected nvcc 12.0+")
    assert "set CUDA_HOME" in line
    old = jitcache.NvccFacts(path="/opt/cuda-11.8/bin/nvcc", how="CUDA_HOME=/opt/cuda-11.8", version="11.8")
    line = failed(with_nvcc(old))["jit.compiler"].line()
    assert "found nvcc 11.8 at /opt/cuda-11.8/bin/nvcc" in line and "CUDA 12.0+ toolkit" in line


def fake_nvcc(home, text, rc=0):
    os.makedirs(home / "bin", exist_ok=True)
    p = home / "bin" / "nvcc"
    p.write_text(f"#!/bin/sh\necho '{text}'\nexit {rc}\n")
    p.chmod(0o755)
    return str(p)


def test_nvcc_is_found_as_sglangs_jit_finds_it(tmp_path):
    """tvm-ffi's order: CUDA_HOME (or CUDA_PATH), then PATH, then /usr/local/cuda; the release read from
    `nvcc --version` (a stand-in nvcc script here: the probe is what is tested)."""
    on_path = fake_nvcc(tmp_path / "p", "Cuda compilation tools, release 12.4, V12.4.131")
    f = jitcache.nvcc_facts({"PATH": str(tmp_path / "p" / "bin")})
    assert (f.path, f.how, f.version, f.error) == (on_path, "PATH", "12.4", None)
    home = tmp_path / "h"
    fake_nvcc(home, "Cuda compilation tools, release 13.0, V13.0.48")
    f = jitcache.nvcc_facts({"CUDA_HOME": str(home), "PATH": str(tmp_path / "p" / "bin")})
    assert f.version == "13.0" and f.how == f"CUDA_HOME={home}"  # CUDA_HOME wins over PATH
    f = jitcache.nvcc_facts({"CUDA_HOME": str(tmp_path / "none"), "PATH": str(tmp_path / "p" / "bin")})
    assert f.path is None and f.error == f"no nvcc at {tmp_path / 'none' / 'bin' / 'nvcc'}"
    fake_nvcc(tmp_path / "bad", "segmentation fault", rc=139)
    f = jitcache.nvcc_facts({"CUDA_PATH": str(tmp_path / "bad")})
    assert f.version is None and "exited 139 without a release: segmentation fault" in f.error
    assert failed(with_nvcc(f))["jit.compiler"].status == "fail"


class _Captured(Exception):
    pass


def _sglang_build_dir(module_fn, arch=(8, 0, "")):
    """The module name and build directory SGLang 0.5.16's own load_jit gives `module_fn`'s module on a GPU of `arch`,
    captured where load_jit hands them to tvm-ffi's compiler (intercepted there: no nvcc, no GPU here)."""
    import torch
    import tvm_ffi.cpp
    from sglang.jit_kernel.utils.arch import override_jit_cuda_arch

    seen = {}

    def record(name, *args, build_directory=None, **kwargs):
        seen.update(name=name, directory=build_directory)
        raise _Captured

    originals = tvm_ffi.cpp.load_inline, tvm_ffi.cpp.load
    tvm_ffi.cpp.load_inline = tvm_ffi.cpp.load = record
    try:
        with override_jit_cuda_arch(*arch), pytest.raises(_Captured):
            getattr(module_fn, "__wrapped__", module_fn)(torch.bfloat16)
    finally:
        tvm_ffi.cpp.load_inline, tvm_ffi.cpp.load = originals
    return seen["name"], os.path.basename(seen["directory"])


@pytest.mark.sglang
def test_a_mode_whose_first_forward_builds_a_jit_module_is_a_cold_start(tmp_path, monkeypatch):
    """fp8_marlin dense and marlin experts call SGLang JIT modules (gptq_marlin, moe_wna16_marlin) that are built at
    the first forward, not while loading (on the H200 host, 2026-12-04: still building 3 minutes into it). A cache
    warm from another mode lacks them: the start is cold for the watchdog (serve raises it) and doctor says so. The
    module directories are the ones SGLang's own naming gives, the .so inside what makes them built."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    from sglang.jit_kernel.gptq_marlin import _jit_gptq_marlin_module
    from sglang.jit_kernel.moe_wna16_marlin import _jit_moe_wna16_marlin_module

    tvm = tmp_path / "tvm"
    (tvm / "sgl_kernel_jit_dsv4_other").mkdir(parents=True)  # warm from the default modes
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path / "sglang-sees"))  # no prebuilt module for load_jit to load
    environ = {"TVM_FFI_CACHE_DIR": str(tvm), "TRITON_CACHE_DIR": str(tmp_path / "t")}
    assert jitcache.modules_missing(str(tvm), environ) == []  # bf16 + mxfp4_int8 need neither
    both = {**environ, "SGLANG_DSV4_A100_DENSE": "fp8_marlin", "SGLANG_DSV4_MXFP4_MOE_BACKEND": "marlin"}
    assert jitcache.modules_missing(str(tvm), both) == [
        "gptq_marlin (SGLANG_DSV4_A100_DENSE=fp8_marlin)", "moe_wna16_marlin (SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin)"]
    reasons = [r for r in jitcache.cold_reasons(both) if "SGLang" in r]
    assert len(reasons) == 1 and "gptq_marlin (" in reasons[0] and "first forward" in reasons[0]
    tvm_facts = [f for f in jitcache.facts(both) if f.label.startswith("SGLang JIT")][0]
    line = {x.check: x for x in cc.evaluate(with_jit([tvm_facts]))}["jit.cache"]
    assert line.status == "pass" and "gptq_marlin (SGLANG_DSV4_A100_DENSE=fp8_marlin)" in line.found

    name, d = _sglang_build_dir(_jit_gptq_marlin_module)
    assert name.startswith("sgl_kernel_jit_gptq_marlin_bf16_t_") and d.startswith(f"{name}__arch_8.0__tvmffi_"), d
    (tvm / d).mkdir()
    (tvm / d / "build.ninja").write_text("")  # a build cut half-way: sources, no .so
    assert not jitcache.module_built(str(tvm), "gptq_marlin")
    (tvm / d / f"{name}.so").write_bytes(b"")
    assert jitcache.module_built(str(tvm), "gptq_marlin")
    # the repack module, built at load, is another module and does not count as the GEMM's
    rname = "sgl_kernel_jit_gptq_marlin_repack_0123456789abcdef"
    (tvm / f"{rname}__arch_8.0__tvmffi_0.1.11").mkdir()
    (tvm / f"{rname}__arch_8.0__tvmffi_0.1.11" / f"{rname}.so").write_bytes(b"")
    assert jitcache.modules_missing(str(tvm), both) == ["moe_wna16_marlin (SGLANG_DSV4_MXFP4_MOE_BACKEND=marlin)"]
    name, d = _sglang_build_dir(_jit_moe_wna16_marlin_module, arch=(9, 0, "a"))  # any arch counts
    (tvm / d).mkdir()
    (tvm / d / f"{name}.so").write_bytes(b"")
    assert jitcache.modules_missing(str(tvm), both) == [] and jitcache.cold_reasons(both) == [
        f"no SM80 kernel in the Triton cache at {tmp_path / 't'}"]


def test_the_seeds_module_names_are_the_layout_module_built_reads(tmp_path):
    """The directories tvm-ffi made on a real H200 host (the committed JIT seed, packed there: moe_wna16_marlin among
    them), each with the .so its build.ninja names, read as built; the seed holds no gptq_marlin (no FP8-Marlin run
    had finished when it was packed), and that one stays missing."""
    import lzma

    seed = json.loads(lzma.open(os.path.join(REPO, "dsv4_lab", "beds", "jit-seed", "tvm-ffi.json.xz")).read())
    for name, files in seed["modules"].items():
        (tmp_path / name).mkdir()
        target = re.search(r"^default (\S+)", files["build.ninja"], re.M).group(1)
        (tmp_path / name / target).write_bytes(b"")
    assert jitcache.module_built(str(tmp_path), "moe_wna16_marlin")
    assert not jitcache.module_built(str(tmp_path), "gptq_marlin")
