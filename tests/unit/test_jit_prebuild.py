"""`python -m dsv4_sm80 prebuild-jit`: SGLang 0.5.16's own JIT modules, built for sm_80 on this CPU machine (nvcc and
the CUDA runtime library are all it needs), and the choice of modules per mode."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from dsv4_sm80 import env, jit_prebuild, jitcache

MARLIN = ("gptq_marlin", "gptq_marlin_repack", "moe_wna16_marlin")


def names(mods):
    return [m.label.split()[0] for m in mods]


@pytest.mark.sglang
def test_the_modes_choose_their_modules():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    mods = jit_prebuild.modules()
    default = names(jit_prebuild.select(mods, {}))
    assert not set(MARLIN) & set(default) and "clamp_position" in default and "custom_all_reduce" in default
    fp8 = names(jit_prebuild.select(mods, {"SGLANG_DSV4_A100_DENSE": "fp8_marlin"}))
    assert set(fp8) - set(default) == {"gptq_marlin", "gptq_marlin_repack"}
    marlin = names(jit_prebuild.select(mods, {"SGLANG_DSV4_MXFP4_MOE_BACKEND": "marlin"}))
    assert set(marlin) - set(default) == {"moe_wna16_marlin"}
    assert len(jit_prebuild.select(mods, {}, all_modes=True)) == len(mods) == len(default) + 3
    assert names(jit_prebuild.select(mods, {}, only=["hash_topk", "metadata"])) == ["attention", "hash_topk"]
    # what first_start_args counts as cold for a mode (built at the first forward) is prebuilt in that mode
    for knob, value, module in jitcache.FIRST_FORWARD_MODULES:
        assert module in names(jit_prebuild.select(mods, {knob.name: value}))
    with pytest.raises(env.EnvError):
        jit_prebuild.select(mods, {"SGLANG_DSV4_A100_DENSE": "fp8"})


def test_arch_spelling():
    assert jit_prebuild.parse_arch("8.0") == (8, 0, "") and jit_prebuild.parse_arch("9.0a") == (9, 0, "a")
    assert jit_prebuild.parse_arch("gpu") is None  # SGLang resolves the visible GPU's itself
    with pytest.raises(ValueError, match="8.0 .A800/A100"):
        jit_prebuild.parse_arch("sm80")


def cli(*args, **environ):
    e = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **environ}
    return subprocess.run([sys.executable, "-m", "dsv4_sm80", "prebuild-jit", *args], capture_output=True, text=True,
                          timeout=900, env=e, cwd=REPO)


def test_no_compiler_is_refused_before_anything_is_built(tmp_path):
    p = cli("--only", "hash_topk", CUDA_HOME=str(tmp_path / "nocuda"), TVM_FFI_CACHE_DIR=str(tmp_path / "c"))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL jit.compiler" in p.stderr and str(tmp_path / "nocuda") in p.stderr and "CUDA_HOME" in p.stderr
    assert not (tmp_path / "c").exists()
    p = cli("--arch", "sm80")
    assert p.returncode == 2 and "expected MAJOR.MINOR" in p.stderr


def loud_skip(msg):
    print("\n" + "!" * 100 + "\nSKIPPED: " + msg + "\n" + "!" * 100, file=sys.stderr)
    pytest.skip(msg)


def cuda_home():
    """A CUDA toolkit with nvcc and the runtime library the modules link against (this machine's: CUDA 13.0)."""
    for home in [os.environ.get("CUDA_HOME", ""), *sorted(glob.glob("/usr/local/cuda*"), reverse=True)]:
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) and glob.glob(
                os.path.join(home, "lib64", "libcudart.so*")):
            return home
    return None


@pytest.mark.sglang
def test_the_visible_gpus_arch_needs_a_gpu(tmp_path):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    home = cuda_home()
    if home is None:
        loud_skip("no CUDA toolkit (nvcc + libcudart) on this machine: --arch gpu's refusal is NOT tested")
    p = cli("--arch", "gpu", "--only", "hash_topk", CUDA_HOME=home, TVM_FFI_CACHE_DIR=str(tmp_path / "c"),
            CUDA_VISIBLE_DEVICES="")
    assert p.returncode == 2 and "--arch gpu: no CUDA GPU is visible here" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


@pytest.mark.sglang
def test_sglang_modules_build_for_sm80_on_a_machine_without_a_gpu(tmp_path):
    """Two of the path's modules, compiled by nvcc, linked and loaded by SGLang's own load_jit into the cache
    directories an A800's first call looks for (`__arch_8.0__`, PDL off in the template arguments), several at a
    time; a second run finds them there."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    home = cuda_home()
    if home is None:
        loud_skip("no CUDA toolkit (nvcc + libcudart) on this machine: the sm_80 build is NOT tested")
    cache = tmp_path / "tvm"
    p = cli("--only", "hash_topk,clamp_position", "--jobs", "2", "--out", str(tmp_path / "r.json"),
            CUDA_HOME=home, TVM_FFI_CACHE_DIR=str(cache))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 SGLang JIT modules for sm_80" in p.stdout and p.stdout.count("  OK   ") == 2
    dirs = sorted(os.listdir(cache))
    assert len(dirs) == 2 and all("__arch_8.0__tvmffi_" in d for d in dirs), dirs
    assert any(d.startswith("sgl_kernel_jit_dpsk_v4_hash_topk_act_sqrt_softplus_false_") for d in dirs), dirs
    for d in dirs:
        so = cache / d / (d.split("__arch_")[0] + ".so")
        assert so.is_file()
        flags = set(re.findall(r"arch=compute_\d+a?,code=sm_\d+a?", (cache / d / "build.ninja").read_text()))
        assert flags == {"arch=compute_80,code=sm_80"}, flags  # what nvcc was asked for
        cuobjdump = shutil.which("cuobjdump") or os.path.join(home, "bin", "cuobjdump")
        if os.path.isfile(cuobjdump):  # and what the .so holds, where the toolkit has cuobjdump
            elf = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True).stdout
            assert "sm_80" in elf and "sm_90" not in elf, elf
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["arch"] == "sm_80" and all(r["ok"] for r in record["results"])
    again = cli("--only", "hash_topk,clamp_position", "--jobs", "2", CUDA_HOME=home, TVM_FFI_CACHE_DIR=str(cache))
    assert again.returncode == 0 and "2 of 2 built or already there" in again.stdout
    assert sorted(os.listdir(cache)) == dirs
