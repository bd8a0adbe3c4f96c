"""The JIT caches this datapath writes, checked before start and watched while it builds.

A cold start of the SM80 path compiles kernels into three caches: Triton's (our kernels and SGLang's
Triton kernels), SGLang's tvm-ffi JIT modules (`load_jit`) and TileLang's (what a cold start writes:
docs/results/README.md). A disk that fills half-way through shows up deep in a compiler as a linker or
ninja failure; here:

- `facts()` / `gate.check_jit_cache`: before start, each cache directory must be writable and
  its filesystem must have at least MIN_FREE_BYTES free, or the gate refuses, naming the directory.
- `disk_full_error`: the `jit.disk_full` error a build or cache write that fails for lack of space is
  re-raised as, naming the module, the directory, what is free and what to do, instead of the compiler's
  output; raised around SGLang's `load_jit` by the launch stage (seam `launch.jit_disk_full`) and by
  `triton_cache.DiskFullClearCacheManager` (Triton's own `TRITON_CACHE_MANAGER` hook, set by the bootstrap).
- `nvcc_facts()` / `gate.check_jit_compiler`: before start, the nvcc those builds run must exist
  and be a 12.x+ release, or the gate refuses (instead of the first build failing while the model loads).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from . import env

# Triton's cache class while the patch is on (set by the bootstrap unless the user chose one): its writes that
# fail for lack of space raise JitCacheFull too (triton_cache.py; named here, where no Triton is imported)
TRITON_CACHE_MANAGER = "dsv4_sm80.triton_cache:DiskFullClearCacheManager"

MIN_FREE_BYTES = 1 << 30  # 1 GiB: several times what a cold start of the tiny model writes


def cache_dirs(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """label -> directory, resolved as each tool resolves it (env override, else its default)."""
    e = os.environ if environ is None else environ
    home = os.path.expanduser("~")
    triton = e.get("TRITON_CACHE_DIR") or os.path.join(e.get("TRITON_HOME") or home, ".triton", "cache")
    return {
        "Triton (TRITON_CACHE_DIR)": triton,
        "SGLang JIT / tvm-ffi (TVM_FFI_CACHE_DIR)":
            os.path.expanduser(e.get("TVM_FFI_CACHE_DIR") or "~/.cache/tvm-ffi"),
        "TileLang (TILELANG_CACHE_DIR)": os.path.expanduser(e.get("TILELANG_CACHE_DIR") or "~/.tilelang/cache"),
    }


@dataclass
class CacheDirFacts:
    label: str
    path: str
    exists: bool = False
    anchor: str = ""  # the directory itself, or its nearest existing ancestor (where it would be created)
    writable: bool = False
    free_bytes: int | None = None
    error: str | None = None
    ours_built: bool | None = None  # Triton's cache only: this path's kernels compiled here before (warm)
    # SGLang's tvm-ffi cache only: FIRST_FORWARD_MODULES the configured modes need that are not built here yet
    modules_missing: list | None = None


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def probe(label: str, path: str) -> CacheDirFacts:
    f = CacheDirFacts(label=label, path=path, exists=os.path.isdir(path))
    f.anchor = _nearest_existing(path)
    try:
        f.free_bytes = shutil.disk_usage(f.anchor).free
    except OSError as e:
        f.error = f"{type(e).__name__}: {e}"
    if not os.path.isdir(f.anchor):
        f.error = f.error or f"{f.anchor} is not a directory"
        return f
    if f.exists:  # a real write: access() says yes on read-only mounts and to root
        name = os.path.join(path, f".dsv4-sm80-probe-{uuid.uuid4().hex}")
        try:
            with open(name, "wb") as fh:
                fh.write(b"x")
            os.remove(name)
            f.writable = True
        except OSError as e:
            f.error = f"{type(e).__name__}: {e}"
    else:  # it will be created under anchor
        f.writable = os.access(f.anchor, os.W_OK | os.X_OK)
        if not f.writable:
            f.error = f"cannot create it under {f.anchor}"
    return f


# Kernels every patched forward runs (attention, and the experts under the default backend): if Triton's cache
# has neither, this host has not compiled the SM80 path yet and its first requests will (README: first start).
OUR_TRITON_KERNELS = ("_sparse_attn_kernel", "_w4a8_moe_kernel")


def ours_built(triton_dir: str) -> bool:
    """Whether Triton's cache directory holds a build of any of OUR_TRITON_KERNELS (its entries are one
    directory per build, holding `<kernel name>.json` and the binaries)."""
    try:
        entries = list(os.scandir(triton_dir))
    except OSError:
        return False
    for e in entries:
        try:
            if e.is_dir() and any(n.startswith(OUR_TRITON_KERNELS) for n in os.listdir(e.path)):
                return True
        except OSError:
            continue
    return False


# SGLang JIT (tvm-ffi) modules a mode builds at its first forward, not while loading: (knob, value, module). The
# load builds others (the repacks, the mHC prewarm), and a cold cache is caught as a whole by cold_reasons; these
# are what a host that has served another mode before still lacks (a first forward builds them for minutes:
# docs/results/README.md).
FIRST_FORWARD_MODULES = (
    (env.DENSE, "fp8_marlin", "gptq_marlin"),  # jit_kernel/gptq_marlin.py:19, the FP8-Marlin W8A16 GEMM
    (env.MOE_BACKEND, "marlin", "moe_wna16_marlin"),  # jit_kernel/moe_wna16_marlin.py:19, the MXFP4 Marlin MoE
)


def module_built(tvm_dir: str, module: str) -> bool:
    """Whether SGLang's tvm-ffi cache holds a built `module` for BF16 (any GPU arch): load_jit's directory
    `sgl_kernel_jit_<module>_bf16_t_<source hash>__arch_<arch>__tvmffi_<version>` with its `.so` in it
    (jit_kernel/utils/compile.py:164-250; what load_jit loads without building)."""
    pat = re.compile(rf"^(sgl_kernel_jit_{re.escape(module)}_bf16_t_[0-9a-f]+)__arch_")
    try:
        entries = list(os.scandir(tvm_dir))
    except OSError:
        return False
    for e in entries:
        m = pat.match(e.name)
        if m and os.path.isfile(os.path.join(e.path, m.group(1) + ".so")):
            return True
    return False


def modules_missing(tvm_dir: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """`module (KNOB=value)` for each FIRST_FORWARD_MODULES entry the configured modes need and the cache lacks."""
    out = []
    for knob, value, module in FIRST_FORWARD_MODULES:
        try:
            chosen = env.get(knob, environ)
        except env.EnvError:
            continue  # the gate's env check refuses the value itself
        if chosen == value and not module_built(tvm_dir, module):
            out.append(f"{module} ({knob.name}={value})")
    return out


def _has_entries(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except OSError:
        return False


def cold_reasons(environ: Mapping[str, str] | None = None) -> list[str]:
    """Why a start on this host would compile for minutes before its first forward ends (empty: warm): none of
    this path's kernels in Triton's cache, an empty SGLang JIT (tvm-ffi) cache, or one without a module the
    configured modes build at their first forward (FIRST_FORWARD_MODULES)."""
    out = []
    for f in facts(environ):
        if f.label.startswith("Triton") and not f.ours_built:
            out.append(f"no SM80 kernel in the Triton cache at {f.path}")
        if f.label.startswith("SGLang JIT"):
            if not _has_entries(f.path):
                out.append(f"SGLang's JIT cache at {f.path} is empty")
            elif f.modules_missing:
                out.append(f"SGLang's JIT cache at {f.path} lacks {', '.join(f.modules_missing)}, built at the first "
                           "forward")
    return out


def facts(environ: Mapping[str, str] | None = None) -> list[CacheDirFacts]:
    out = [probe(label, path) for label, path in cache_dirs(environ).items()]
    for f in out:
        if f.label.startswith("Triton"):
            f.ours_built = f.exists and ours_built(f.path)
        if f.label.startswith("SGLang JIT"):
            f.modules_missing = modules_missing(f.path, environ)
    return out


# --- the compiler the JIT builds need ---------------------------------------------------------------
# SGLang's JIT modules (tvm-ffi `load_jit`: compressors, RoPE, top-k, metadata, Marlin, the all-reduce), the
# TileLang mHC kernels and FlashInfer's sampling build with nvcc at first use (the mHC prewarm: while loading).
# TileLang compiles with -std=c++20, which nvcc has from 12.0.
MIN_NVCC = (12, 0)


@dataclass
class NvccFacts:
    path: str | None = None  # the nvcc SGLang's JIT would run, None: none found
    how: str = ""  # how it was found (tvm-ffi's order: CUDA_HOME / CUDA_PATH, PATH, /usr/local/cuda)
    version: str | None = None  # "12.8"
    error: str | None = None


def nvcc_facts(environ: Mapping[str, str] | None = None) -> NvccFacts:
    """Find nvcc as tvm-ffi's `_find_cuda_home` does (the strictest of SGLang's JIT paths; TileLang also
    searches the nvidia-cuda-nvcc wheel) and ask it its release."""
    import re
    import subprocess

    environ = os.environ if environ is None else environ
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    on_path = shutil.which("nvcc", path=environ.get("PATH", ""))
    if home:
        f = NvccFacts(path=os.path.join(home, "bin", "nvcc"),
                      how=f"{'CUDA_HOME' if environ.get('CUDA_HOME') else 'CUDA_PATH'}={home}")
    elif on_path:
        f = NvccFacts(path=on_path, how="PATH")
    else:
        f = NvccFacts(path="/usr/local/cuda/bin/nvcc", how="/usr/local/cuda (CUDA_HOME unset, no nvcc on PATH)")
    if not os.path.isfile(f.path):
        f.error, f.path = f"no nvcc at {f.path}", None
        return f
    try:
        r = subprocess.run([f.path, "--version"], capture_output=True, text=True, timeout=60)
        m = re.search(r"release (\d+)\.(\d+)", r.stdout)
        if m:
            f.version = f"{m.group(1)}.{m.group(2)}"
        else:
            said = (r.stdout + r.stderr).strip()[-200:]
            f.error = f"`nvcc --version` exited {r.returncode} without a release: {said}"
    except (OSError, subprocess.SubprocessError) as e:
        f.error = f"{type(e).__name__}: {e}"
    return f


def gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / (1 << 30):.2f} GiB"


class JitCacheFull(RuntimeError):
    """A JIT build failed because its cache's disk is full."""


def disk_full(exc: BaseException) -> bool:
    """Whether a full disk (ENOSPC/EDQUOT, or a compiler's message saying so) is anywhere in the exception chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(what: str, where: str, cache_vars: str, exc: BaseException) -> JitCacheFull:
    """The jit.disk_full error for a failed cache write or build (`what`) under directory `where`: what is
    free on its disk, what a cold start needs, which variables move the caches (`cache_vars`), the cause."""
    try:
        free = shutil.disk_usage(_nearest_existing(where)).free
    except OSError:
        free = None
    return JitCacheFull(
        f"dsv4-sm80 jit.disk_full: {what} failed: no space left on the device of {where} ({gib(free)} free; a "
        f"cold start needs about {gib(MIN_FREE_BYTES)}). Free space there, or set {cache_vars} to a disk with "
        f"room, then restart. Cause: {type(exc).__name__}: {str(exc)[-300:]}")
