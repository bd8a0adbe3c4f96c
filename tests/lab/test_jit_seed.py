"""dsv4_lab/beds/jit_seed.py with tvm-ffi's own builder on the CPU: modules built by `tvm_ffi.cpp.load_inline` (the
call SGLang's `load_jit` makes; C++ only here, no nvcc), packed, rebuilt in parallel into another cache, and then
found there by `load_inline` without a rebuild (the `.so` untouched: the restored build.ninja and sources are what
tvm-ffi itself writes for that directory)."""

import importlib
from pathlib import Path

import pytest

from conftest import REPO
from dsv4_lab.gpu.suite import BY_NAME

tvm_cpp = pytest.importorskip("tvm_ffi.cpp", reason="tvm-ffi comes with sglang==0.5.16 (CI installs it)")

jit_seed = importlib.import_module("dsv4_lab.beds.jit_seed")

SRC = r"""
#include <tvm/ffi/function.h>
int {fn}(int x) {{ return x + {k}; }}
TVM_FFI_DLL_EXPORT_TYPED_FUNC({fn}, {fn});
"""


def make(cache, name, k, **kw):
    """A module as SGLang's load_jit makes one: load_inline into a fixed directory of the cache."""
    return tvm_cpp.load_inline(name, cpp_sources=SRC.format(fn=f"add_{k}", k=k),
                               build_directory=str(cache / f"{name}__arch_test"), **kw)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    a = tmp_path_factory.mktemp("cacheA")
    for k in (1, 2, 3):
        assert getattr(make(a, f"seedmod{k}", k), f"add_{k}")(40) == 40 + k
    # a build cut short: sources and build.ninja, no .so
    (a / "cut__arch_test").mkdir()
    (a / "cut__arch_test" / "build.ninja").write_text("rule x\n  command = true\nbuild cut.so: x\ndefault cut.so\n")
    seed = jit_seed.pack(a)
    return a, seed


def test_pack_keeps_built_modules_only(packed):
    a, seed = packed
    assert sorted(seed["modules"]) == [f"seedmod{k}__arch_test" for k in (1, 2, 3)]
    files = seed["modules"]["seedmod1__arch_test"]
    assert set(files) == {"build.ninja", "main.cpp"}  # C++ only: no cuda.cu
    assert jit_seed.ninja_default(files["build.ninja"]) == "seedmod1.so"
    assert seed["cache"] == str(a.resolve())


def test_seed_file_round_trip(packed, tmp_path):
    _, seed = packed
    for name in ("s.json", "s.json.xz"):
        jit_seed.write_seed(jit_seed.merge(seed), tmp_path / name)
        back = jit_seed.read_seed(tmp_path / name)
        assert sorted(back["modules"]) == sorted(seed["modules"])
    (tmp_path / "bad.json").write_text('{"format": "other", "modules": {}}')
    with pytest.raises(SystemExit, match="not a seed of this tool"):
        jit_seed.read_seed(tmp_path / "bad.json")


def test_build_into_a_new_cache_then_load_inline_does_not_rebuild(packed, tmp_path):
    a, seed = packed
    b = tmp_path / "cacheB"
    # through a file, merged: each module keeps the cache it came from, and moves to b
    jit_seed.write_seed(jit_seed.merge(seed), tmp_path / "seed.json.xz")
    report = jit_seed.build(jit_seed.read_seed(tmp_path / "seed.json.xz"), b, jobs=2)
    assert report.count("built") == 3 and report.count("failed") == 0, report.results
    for k in (1, 2, 3):
        d = b / f"seedmod{k}__arch_test"
        so = d / f"seedmod{k}.so"
        assert so.is_file()
        assert str(a) not in (d / "build.ninja").read_text()  # the module's own paths moved to b
        before = so.stat().st_mtime_ns
        m = make(b, f"seedmod{k}", k)  # tvm-ffi rewrites nothing and ninja finds nothing to do
        assert getattr(m, f"add_{k}")(1) == 1 + k
        assert so.stat().st_mtime_ns == before
    again = jit_seed.build(seed, b, jobs=2)
    assert again.count("present") == 3 and again.count("built") == 0


def test_missing_paths_skip_a_module_and_a_broken_one_fails(packed, tmp_path):
    _, seed = packed
    mods = dict(seed["modules"])
    m1 = dict(mods["seedmod1__arch_test"])
    m1["build.ninja"] = m1["build.ninja"].replace("cxxflags = ", "cxxflags = -I/nonexistent/include/dir ", 1)
    m2 = dict(mods["seedmod2__arch_test"])
    m2["main.cpp"] = m2["main.cpp"] + "\nthis is not C++;\n"
    mods["seedmod1__arch_test"], mods["seedmod2__arch_test"] = m1, m2
    lines = []
    report = jit_seed.build(dict(seed, modules=mods), tmp_path / "c", jobs=2, log=lines.append)
    by = {r.name: r for r in report.results}
    assert by["seedmod1__arch_test"].status == "skipped"
    assert "/nonexistent/include/dir" in by["seedmod1__arch_test"].detail
    assert by["seedmod2__arch_test"].status == "failed" and "ninja exited" in by["seedmod2__arch_test"].detail
    assert by["seedmod3__arch_test"].status == "built"
    assert any("seedmod2__arch_test: FAILED" in s for s in lines)
    assert any("seedmod1__arch_test: skipped" in s for s in lines)
    assert "1 built" in report.summary() and "1 failed" in report.summary()


def test_a_file_with_other_content_is_left_alone(packed, tmp_path):
    _, seed = packed
    c = tmp_path / "c"
    d = c / "seedmod3__arch_test"
    d.mkdir(parents=True)
    (d / "main.cpp").write_text("// another version's source\n")
    report = jit_seed.build(seed, c, jobs=1)
    r = {r.name: r for r in report.results}["seedmod3__arch_test"]
    assert r.status == "skipped" and "other content" in r.detail
    assert (d / "main.cpp").read_text() == "// another version's source\n"


def test_referenced_paths_reads_includes_tools_and_sources():
    files = {
        "build.ninja": "cxx = /opt/gcc/bin/c++\nnvcc = /usr/local/cuda/bin/nvcc\n"
                       "cxxflags = -O2 -I/site/tvm_ffi/include -isystem /site/dlpack\n"
                       "cuda_cflags = -gencode arch=compute_90a,code=sm_90a -I/site/sglang/include\n"
                       "build cuda_0.o: compile_cuda /site/sglang/csrc/a.cuh\n",
        "cuda.cu": '#include "/site/sglang/csrc/b.cuh"\n#include <cstdint>\n',
    }
    assert jit_seed.referenced_paths(files) == sorted({
        "/opt/gcc/bin/c++", "/usr/local/cuda/bin/nvcc", "/site/tvm_ffi/include", "/site/dlpack",
        "/site/sglang/include", "/site/sglang/csrc/a.cuh", "/site/sglang/csrc/b.cuh"})


def test_cli_pack_and_build(packed, tmp_path):
    a, _ = packed
    seed = tmp_path / "seed.json.xz"
    assert jit_seed.main(["pack", "--cache", str(a), "--out", str(seed)]) == 0
    assert jit_seed.main(["build", "--seed", str(seed), "--cache", str(tmp_path / "c"), "-j", "2"]) == 0
    assert (tmp_path / "c" / "seedmod2__arch_test" / "seedmod2.so").is_file()


def test_build_defaults_to_the_cache_the_seed_came_from(packed, tmp_path):
    a, seed = packed
    assert jit_seed.origin(seed) == a.resolve()
    assert jit_seed.origin(jit_seed.merge(seed)) == a.resolve()
    assert jit_seed.origin(jit_seed.merge(seed, {"format": jit_seed.FORMAT, "cache": "/elsewhere",
                                                 "modules": {"x": {}}})) is None
    f = tmp_path / "seed.json"
    jit_seed.write_seed(seed, f)
    # every module of a is built: `build` without --cache goes to a and finds them there
    before = {p: p.stat().st_mtime_ns for p in a.glob("*/*.so")}
    assert jit_seed.main(["build", "--seed", str(f)]) == 0
    assert {p: p.stat().st_mtime_ns for p in a.glob("*/*.so")} == before


def test_pack_unfinished_keeps_a_module_still_building(packed):
    # a run cut mid-build: its sources and build.ninja are there, its .so not yet
    a, _ = packed
    seed = jit_seed.pack(a, unfinished=True)
    assert sorted(seed["modules"]) == ["cut__arch_test"] + [f"seedmod{k}__arch_test" for k in (1, 2, 3)]
    assert set(seed["modules"]["cut__arch_test"]) == {"build.ninja"}


def test_the_committed_seeds_are_this_tools():
    # the seeds the suite's jit-seed job builds on a fresh host (packed on an H200 host by `jit_seed.py pack`)
    argv = " ".join(BY_NAME["jit-seed"].argv)
    assert all(f"build --seed dsv4_lab/beds/jit-seed/{n}.json.xz" in argv for n in ("tvm-ffi", "flashinfer")), argv
    for name in ("tvm-ffi", "flashinfer"):
        # read_seed refuses another format
        seed = jit_seed.read_seed(Path(REPO, "dsv4_lab", "beds", "jit-seed", f"{name}.json.xz"))
        assert seed["modules"], name
        assert all("build.ninja" in files for files in seed["modules"].values()), name
