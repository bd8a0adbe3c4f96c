"""SGLang's JIT modules built in parallel from a seed, instead of one at a time inside a first forward.

SGLang 0.5.16 builds each tvm-ffi JIT module (`sglang.jit_kernel.utils.compile.load_jit`) the first time a
forward calls it, one `nvcc` after another: a native DSV4 start on empty caches was still building, on one of the
H200 host's 16 cores, 16 minutes after launch (docs/results/README.md, 2026-12-03). Each module is a directory of the
tvm-ffi cache (`$TVM_FFI_CACHE_DIR`, default `~/.cache/tvm-ffi`) holding the generated sources (`main.cpp`,
`cuda.cu`), a `build.ninja` and, once built, `<module>.so`; `load_jit` loads a present `.so` without building.

    python -m dsv4_lab.beds.jit_seed pack  --out seed.json.xz    # after a run: every built module's sources
    python -m dsv4_lab.beds.jit_seed build --seed seed.json.xz   # on a fresh host: the missing ones, all cores

`pack` keeps the text files of every directory whose `.so` exists (with `--unfinished`, also those still building:
build.ninja written, no `.so` yet), a few KB per module; `build` writes them back where absent (files that exist
must hold the same text, as tvm-ffi's own `_maybe_write` leaves them) and runs ninja in those directories in
parallel, each under the directory's `lock` that tvm-ffi takes around its own build (an engine starting meanwhile
waits for that module instead of building
it twice). A seed names absolute paths of the host it was packed on (include directories, nvcc, the sources
`#include`d); a module whose paths are absent here is skipped and named. Lab tooling for the offline GPU host
(the GPU suite's `jit-seed` job builds `dsv4_lab/beds/jit-seed/*.json.xz` before any engine starts).

FlashInfer's JIT modules (its sampling kernels: `~/.cache/flashinfer/<version>/<arch>/cached_ops/<module>`) have the
same shape (a build.ninja whose `default` is the `.so`) and pack the same way with `--cache` pointing there; FlashInfer
locks elsewhere (its tmpdir), so build its seed before any engine starts, as the suite's `jit-seed` job does.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "dsv4-sm80 tvm-ffi jit seed 1"
# the text files tvm-ffi writes into a module's directory (build_inline: main.cpp, cuda.cu; _build_impl: build.ninja)
TEXT_FILES = ("build.ninja", "main.cpp", "cuda.cu")
MAX_FILE_BYTES = 1 << 20  # a generated source over 1 MiB is not one of these


def cache_dir(environ=None) -> Path:
    """tvm-ffi's cache as the gate's jit.cache check resolves it (dsv4_sm80.jitcache.cache_dirs)."""
    from dsv4_sm80.jitcache import cache_dirs

    (path,) = [p for label, p in cache_dirs(environ).items() if label.startswith("SGLang JIT")]
    return Path(path)


def ninja_default(text: str) -> str | None:
    """The target of build.ninja's `default` line: the module's `.so` (or `.o`) file name."""
    m = re.findall(r"^default\s+(\S+)\s*$", text, flags=re.M)
    return m[-1] if m else None


def built(directory: Path) -> bool:
    """Whether the module in `directory` finished building: its build.ninja's default target exists."""
    try:
        target = ninja_default((directory / "build.ninja").read_text())
    except OSError:
        return False
    return bool(target) and (directory / target).is_file()


def pack(cache: Path, unfinished: bool = False) -> dict:
    """Every built module's text files under `cache` (name -> {file: text}); unfinished: also those with a
    build.ninja and no `.so` yet, the module being built when a run is cut (tvm-ffi writes the sources first and
    build.ninja last, then runs ninja): a run cut by its time limit can end with one such build 2 minutes in, and a seed
    without it leaves the next host to build it alone again. One that failed here fails in `build` too, named."""
    modules = {}
    for d in sorted(p for p in cache.iterdir() if p.is_dir()) if cache.is_dir() else []:
        if not (built(d) or (unfinished and (d / "build.ninja").is_file())):
            continue
        files = {}
        for name in TEXT_FILES:
            f = d / name
            if f.is_file() and f.stat().st_size <= MAX_FILE_BYTES:
                files[name] = f.read_text()
        modules[d.name] = files
    # tvm-ffi writes the module's own files into build.ninja by absolute path: `build` moves them to its cache
    return {"format": FORMAT, "cache": str(cache.resolve()), "modules": modules}


def write_seed(seed: dict, out: Path) -> None:
    data = json.dumps(seed, indent=0, sort_keys=True).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(lzma.compress(data, preset=9) if out.suffix == ".xz" else data)
    tmp.replace(out)


def read_seed(path: Path) -> dict:
    data = path.read_bytes()
    if path.suffix == ".xz":
        data = lzma.decompress(data)
    seed = json.loads(data)
    if seed.get("format") != FORMAT:
        raise SystemExit(f"jit_seed: {path} is not a seed of this tool (format {seed.get('format')!r}, "
                         f"expected {FORMAT!r}): pack it again with `jit_seed.py pack`")
    return seed


def merge(*seeds: dict) -> dict:
    """One seed of several (the later wins a module both hold); each module keeps its own cache's path."""
    modules = {}
    for s in seeds:
        for name, files in s["modules"].items():
            modules[name] = dict(files, **({_CACHE_KEY: s["cache"]} if s.get("cache") else {}))
    return {"format": FORMAT, "modules": dict(sorted(modules.items()))}


_CACHE_KEY = "@cache"  # in a merged seed's module: the cache directory it was packed from


def origin(seed: dict) -> Path | None:
    """The one cache directory every module of `seed` was packed from, if they share one."""
    found = {m.get(_CACHE_KEY) for m in seed["modules"].values()} | ({seed["cache"]} if seed.get("cache") else set())
    found.discard(None)
    return Path(found.pop()) if len(found) == 1 else None


def moved(files: dict, origin: str | None, name: str, cache: Path) -> dict:
    """The module's text files with its directory on the packing host (origin/name) replaced by cache/name."""
    files = {k: v for k, v in files.items() if k != _CACHE_KEY}
    new = str(cache.resolve() / name)
    old = str(Path(origin) / name) if origin else new
    if old == new:
        return files
    return {k: v.replace(old + "/", new + "/") for k, v in files.items()}


def referenced_paths(files: dict) -> list[str]:
    """Absolute paths a module's build needs from this host: `-I` directories and tools of build.ninja, and
    the files its sources `#include` by absolute path. Paths into the module's own directory are left out."""
    out = []
    ninja = files.get("build.ninja", "")
    for line in ninja.splitlines():
        if line.startswith(("cxx =", "nvcc =", "cc =", "cxxflags =", "cuda_cflags =", "cflags =")):
            for tok in shlex.split(line.split("=", 1)[1]):
                p = tok[2:] if tok.startswith("-I") else tok
                if p.startswith("/"):
                    out.append(p)
        m = re.match(r"^build \S+: \S+ (.+)$", line)
        if m:  # sources given by absolute path (tvm_ffi.cpp.load: SGLang's own csrc files)
            out += [s for s in m.group(1).split() if s.startswith("/")]
    for name in ("main.cpp", "cuda.cu"):
        out += re.findall(r'^\s*#include\s+"(/[^"]+)"', files.get(name, ""), flags=re.M)
    return sorted(set(out))


@dataclass
class Result:
    name: str
    status: str  # built, present, skipped, failed
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Report:
    results: list = field(default_factory=list)
    wall: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def summary(self) -> str:
        work = sum(r.seconds for r in self.results if r.status == "built")
        return (f"jit_seed: {len(self.results)} modules: {self.count('built')} built, {self.count('present')} "
                f"already built, {self.count('skipped')} skipped, {self.count('failed')} failed; "
                f"{self.wall:.1f} s wall for {work:.1f} s of builds" + self.slowest())

    def slowest(self, n: int = 5) -> str:
        """The longest builds: what a cold host's wall time is made of."""
        top = sorted((r for r in self.results if r.status == "built"), key=lambda r: -r.seconds)[:n]
        return "; slowest: " + ", ".join(f"{r.name} {r.seconds:.0f} s" for r in top) if top else ""


def _lock(directory: Path):
    from tvm_ffi.utils import FileLock  # tvm-ffi's own lock class, on the file its builds take

    return FileLock(str(directory / "lock"))


def restore(name: str, files: dict, cache: Path, origin: str | None = None) -> Result | None:
    """Write a module's files back (those absent); a Result when it cannot or need not be built."""
    d = cache / name
    if built(d):
        return Result(name, "present")
    files = moved(files, files.get(_CACHE_KEY, origin), name, cache)
    own = str(d.resolve()) + "/"
    missing = [p for p in referenced_paths(files) if not p.startswith(own) and not os.path.exists(p)]
    if missing:
        return Result(name, "skipped", detail=f"absent on this host: {', '.join(missing[:3])}"
                      + (f" (+{len(missing) - 3})" if len(missing) > 3 else ""))
    if "build.ninja" not in files:
        return Result(name, "skipped", detail="no build.ninja in the seed")
    d.mkdir(parents=True, exist_ok=True)
    for fname, text in files.items():
        f = d / fname
        if f.is_file():
            if f.read_text() != text:
                return Result(name, "skipped", detail=f"{f} exists with other content (another SGLang or tvm-ffi?)")
            continue
        tmp = d / f".{fname}.seed-tmp"
        tmp.write_text(text)
        tmp.replace(f)
    return None


def build_one(name: str, cache: Path, ninja: str, jobs_each: int) -> Result:
    d = cache / name
    t0 = time.monotonic()
    with _lock(d):
        if built(d):  # an engine built it while we waited
            return Result(name, "present")
        r = subprocess.run([ninja, "-j", str(jobs_each)], cwd=d, capture_output=True, text=True)
    dt = time.monotonic() - t0
    if r.returncode != 0 or not built(d):
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        return Result(name, "failed", dt, f"ninja exited {r.returncode}: " + " | ".join(tail))
    return Result(name, "built", dt)


def find_ninja() -> str:
    import shutil

    for cand in (shutil.which("ninja"), os.path.join(os.path.dirname(sys.executable), "ninja")):
        if cand and os.path.isfile(cand):
            return cand
    try:
        import ninja  # the PyPI wheel SGLang depends on

        return os.path.join(ninja.BIN_DIR, "ninja")
    except ImportError:
        raise SystemExit("jit_seed: no ninja on PATH nor the `ninja` package: tvm-ffi builds with it too") from None


def build(seed: dict, cache: Path, jobs: int, ninja: str | None = None, log=print) -> Report:
    """Restore and build every module of `seed` missing from `cache`, `jobs` ninja processes at a time."""
    t0 = time.monotonic()
    report = Report()
    todo = []
    cache.mkdir(parents=True, exist_ok=True)
    for name, files in seed["modules"].items():
        r = restore(name, files, cache, seed.get("cache"))
        if r is None:
            todo.append(name)
        else:
            report.results.append(r)
    if todo:
        ninja = ninja or find_ninja()
        # a module is one C++ and one CUDA compile, then a link: two jobs each
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for r in pool.map(lambda n: build_one(n, cache, ninja, 2), todo):
                report.results.append(r)
                if r.status == "failed":
                    log(f"jit_seed: {r.name}: FAILED {r.detail}")
    for r in report.results:
        if r.status == "skipped":
            log(f"jit_seed: {r.name}: skipped, {r.detail}")
    report.wall = time.monotonic() - t0
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="every built module's sources into a seed")
    p.add_argument("--out", type=Path, required=True, help="seed file (.json, or .json.xz compressed)")
    p.add_argument("--cache", type=Path, default=None,
                   help="tvm-ffi cache (default $TVM_FFI_CACHE_DIR or ~/.cache/tvm-ffi)")
    p.add_argument("--merge", type=Path, action="append", default=[],
                   help="an earlier seed to keep beside (repeatable)")
    p.add_argument("--unfinished", action="store_true",
                   help="also modules still building (build.ninja written, no .so yet): a run cut mid-build")
    b = sub.add_parser("build", help="build a seed's modules missing from the cache, in parallel")
    b.add_argument("--seed", type=Path, required=True)
    b.add_argument("--cache", type=Path, default=None,
                   help="cache to build into (default: the one the seed was packed from, when it names one)")
    b.add_argument("-j", "--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="ninja processes at once (two compile jobs each; default half the cores)")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        cache = args.cache or cache_dir()
        seed = merge(*[read_seed(m) for m in args.merge if m.is_file()], pack(cache, args.unfinished))
        write_seed(seed, args.out)
        print(f"jit_seed: packed {len(seed['modules'])} modules from {cache} into {args.out} "
              f"({args.out.stat().st_size} bytes)")
        return 0
    seed = read_seed(args.seed)
    report = build(seed, args.cache or origin(seed) or cache_dir(), args.jobs)
    print(report.summary())
    return 1 if report.count("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
