"""The fail-fast gate of dsv4-sm80: run before SGLang starts (by `serve`, `doctor`, the container
entrypoint, and, with the patch on, by SGLang's own launch through the `launch.gate` seam).

Facts are collected in one place (`collect`); checks are pure functions of the facts, so the
tests inject facts for every red line. Each failed check prints one line: the check, what was
found, what was expected, what to do. Exit status non-zero on any failure; nothing starts.

    python compat_check.py --model-path /models/DeepSeek-V4-Flash-0731 [--json]

Order: compatibility (SGLang 0.5.16 @ fdebc938, exactly 4 visible GPUs of compute capability 8.0,
config architecture, patch active), then the model path and its keys (index, every shard,
native dtypes, no converted tensors, complete vision tensors).

Lab overrides (DSV4_SM80_LAB_GPU_COUNT, DSV4_SM80_LAB_CC) relax only the GPU checks, are never
defaults, and print a banner on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from dsv4_sm80 import env, jitcache, upstream
from dsv4_sm80.checkpoint import format as fmt
from dsv4_sm80.checkpoint.safetensors_io import SafetensorsError, read_header

A800_MIN_MEMORY_GIB = 75.0  # an 80 GB card reports ~79.2 GiB; 40 GB A100s cannot hold the weights
OFFICIAL = "the official, unconverted checkpoint (deepseek-ai/DeepSeek-V4-Flash-0731 or DeepSeek-V4-Flash-Vision-Exp)"


# --- facts -------------------------------------------------------------------------------------

@dataclass
class SGLangFacts:
    location: Optional[str] = None
    version: Optional[str] = None
    sglang_root: Optional[str] = None  # SGLANG_ROOT when it is a git tree
    under_root: bool = False  # the imported package lives in SGLANG_ROOT/python
    git_commit: Optional[str] = None
    git_dirty: Optional[list] = None  # modified tracked files under python/ (None: git unavailable)
    fingerprint_mismatch: dict = field(default_factory=dict)


@dataclass
class GpuFacts:
    devices: list = field(default_factory=list)  # [{"index", "name", "cc", "memory_gib"}]
    error: Optional[str] = None


@dataclass
class PatchFacts:
    where: str = "this interpreter"
    env_value: str = ""
    sitecustomize: Optional[str] = None
    ours: bool = False
    hook_installed: bool = False
    error: Optional[str] = None
    knobs: dict = field(default_factory=dict)  # the import-time SGLang knobs, as that process sees them


@dataclass
class ModelFacts:
    path: Optional[str] = None
    is_dir: bool = False
    config: Optional[dict] = None
    config_error: Optional[str] = None
    index: Optional[dict] = None
    index_error: Optional[str] = None
    headers: dict = field(default_factory=dict)  # shard file -> ShardHeader
    shard_errors: dict = field(default_factory=dict)  # shard file -> problem


@dataclass
class Facts:
    sglang: SGLangFacts
    gpus: GpuFacts
    patch: PatchFacts
    model: ModelFacts
    lab: dict = field(default_factory=dict)
    jit: Optional[list] = None  # [jitcache.CacheDirFacts]; None: not collected
    knobs: Optional[dict] = None  # dsv4-sm80's own env knobs as the launch sees them; None: not collected
    nvcc: Optional[jitcache.NvccFacts] = None  # None: not collected


def collect_sglang(environ=None) -> SGLangFacts:
    environ = os.environ if environ is None else environ
    f = SGLangFacts()
    f.location = upstream.locate_sglang()
    if f.location is None:
        return f
    f.version = upstream.read_version(f.location)
    f.fingerprint_mismatch = upstream.mismatches(f.location)
    root = env.get(env.SGLANG_ROOT, environ)
    if os.path.exists(os.path.join(root, ".git")):
        f.sglang_root = root
        f.under_root = os.path.realpath(f.location).startswith(os.path.realpath(os.path.join(root, "python")) + os.sep)
        f.git_commit = upstream.read_git_head(root)
        if shutil.which("git"):
            r = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", "python"],
                               capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                f.git_dirty = [line[3:] for line in r.stdout.splitlines() if line.strip()]
    return f


_GPU_PROBE = r"""
import ctypes, json
out = {"devices": [], "error": None}
try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    out["error"] = "libcuda.so.1 cannot be loaded (%s): no NVIDIA driver on this machine" % e
else:
    rc = cu.cuInit(0)
    if rc == 100:
        out["error"] = "the driver reports no CUDA device (CUDA_ERROR_NO_DEVICE)"
    elif rc:
        out["error"] = "cuInit failed with CUDA error %d" % rc
    else:
        n = ctypes.c_int()
        cu.cuDeviceGetCount(ctypes.byref(n))
        for i in range(n.value):
            d, major, minor, mem = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
            name = ctypes.create_string_buffer(256)
            cu.cuDeviceGet(ctypes.byref(d), i)
            cu.cuDeviceGetAttribute(ctypes.byref(major), 75, d)
            cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, d)
            cu.cuDeviceGetName(name, 256, d)
            cu.cuDeviceTotalMem_v2(ctypes.byref(mem), d)
            out["devices"].append({"index": i, "name": name.value.decode(errors="replace"),
                                   "cc": "%d.%d" % (major.value, minor.value),
                                   "memory_gib": round(mem.value / 2**30, 1)})
print(json.dumps(out))
"""


def collect_gpus() -> GpuFacts:
    """Visible GPUs (CUDA_VISIBLE_DEVICES applies) from the driver, in a child process so this one
    never initialises CUDA (SGLang forks and spawns after the gate)."""
    try:
        r = subprocess.run([sys.executable, "-I", "-S", "-c", _GPU_PROBE], capture_output=True, text=True, timeout=120)
        return GpuFacts(**json.loads(r.stdout.strip().splitlines()[-1]))
    except Exception as e:  # the probe itself broke: report it as the GPU fact
        return GpuFacts(error=f"GPU probe failed: {type(e).__name__}: {e}")


def collect_patch_here() -> PatchFacts:
    f = PatchFacts(env_value=os.environ.get(env.PATCH.name, ""))
    mod = sys.modules.get("sitecustomize")
    f.sitecustomize = getattr(mod, "__file__", None)
    state = getattr(mod, "DSV4_SM80_STATE", False)
    f.ours = state is not False
    if isinstance(state, dict):
        f.error = state.get("error")
    from dsv4_sm80 import apply

    f.hook_installed = apply.installed()
    f.knobs = {d.name: os.environ.get(d.name) for d in env.IMPORT_TIME_DEFAULTS}
    return f


_PATCH_PROBE = "import dataclasses, json, compat_check; print(json.dumps(dataclasses.asdict(compat_check.collect_patch_here())))"


def collect_patch_in(environ: dict) -> PatchFacts:
    """Whether a Python process started with `environ` (the one `serve` launches) gets the patch:
    the same collection as for this interpreter, run in such a process."""
    r = subprocess.run([sys.executable, "-c", _PATCH_PROBE], env=environ, capture_output=True, text=True, timeout=120)
    where = "the launch environment"
    try:
        return PatchFacts(**dict(json.loads(r.stdout.strip().splitlines()[-1]), where=where))
    except Exception:
        return PatchFacts(where=where, env_value=environ.get(env.PATCH.name, ""),
                          error=f"probe failed: {r.stderr.strip()[-300:]}")


def collect_model(path: Optional[str]) -> ModelFacts:
    f = ModelFacts(path=path)
    if not path:
        return f
    f.is_dir = os.path.isdir(path)
    if not f.is_dir:
        return f
    try:
        with open(os.path.join(path, "config.json")) as fh:
            f.config = json.load(fh)
    except (OSError, ValueError) as e:
        f.config_error = f"{type(e).__name__}: {e}"
    try:
        with open(os.path.join(path, "model.safetensors.index.json")) as fh:
            f.index = json.load(fh)
        if not isinstance(f.index.get("weight_map"), dict):
            raise ValueError("no weight_map")
    except (OSError, ValueError) as e:
        f.index, f.index_error = None, f"{type(e).__name__}: {e}"
        return f
    for shard in sorted(set(f.index["weight_map"].values())):
        p = os.path.join(path, shard)
        if not os.path.isfile(p):
            f.shard_errors[shard] = "missing"
            continue
        try:
            f.headers[shard] = read_header(p)
        except (OSError, SafetensorsError) as e:
            f.shard_errors[shard] = str(e)
    return f


def collect(model_path: Optional[str] = None, patch_environ: Optional[dict] = None) -> Facts:
    return Facts(
        sglang=collect_sglang(),
        gpus=collect_gpus(),
        patch=collect_patch_in(patch_environ) if patch_environ is not None else collect_patch_here(),
        model=collect_model(model_path),
        lab=env.lab_overrides(),
        jit=jitcache.facts(patch_environ),
        nvcc=jitcache.nvcc_facts(patch_environ),
        knobs={k.name: v for k in env.KNOBS
               if (v := (patch_environ if patch_environ is not None else os.environ).get(k.name)) is not None},
    )


# --- checks ------------------------------------------------------------------------------------

@dataclass
class Finding:
    check: str
    status: str  # pass | fail | skip
    found: str = ""
    expected: str = ""
    fix: str = ""

    def line(self) -> str:
        if self.status == "fail":
            return f"FAIL {self.check}: found {self.found}; expected {self.expected}; fix: {self.fix}"
        return f"{self.status.upper()} {self.check}: {self.found}"


def _ok(check, found):
    return Finding(check, "pass", found)


def _fail(check, found, expected, fix):
    return Finding(check, "fail", found, expected, fix)


def _skip(check, why):
    return Finding(check, "skip", why)


def check_sglang(f: SGLangFacts) -> list[Finding]:
    want = f"SGLang {env.SGLANG_VERSION} @ {env.SGLANG_COMMIT[:8]}"
    if f.location is None:
        return [_fail("sglang.installed", "no importable sglang package", want,
                      "run inside the official lmsysorg/sglang:v0.5.16 image or install sglang==0.5.16")]
    out = [_ok("sglang.installed", f.location)]
    if f.version and f.version.startswith("0.5.17"):
        out.append(_fail("sglang.version", f"{f.version} (the 0.5.17 dev-preview)", want,
                         "dsv4-sm80 must never be mixed with the 0.5.17 dev-preview image; use the v0.5.16 image"))
    elif f.version != env.SGLANG_VERSION:
        out.append(_fail("sglang.version", f"{f.version}", want, "use the SGLang v0.5.16 image / sglang==0.5.16"))
    else:
        out.append(_ok("sglang.version", f.version))
    if f.sglang_root:
        if not f.under_root:
            out.append(_fail("sglang.location", f"sglang imported from {f.location}",
                             f"the tree at SGLANG_ROOT={f.sglang_root}/python",
                             "put SGLANG_ROOT/python on PYTHONPATH after the overlay directories"))
        if f.git_commit != env.SGLANG_COMMIT:
            out.append(_fail("sglang.commit", f"git HEAD {f.git_commit} at {f.sglang_root}", env.SGLANG_COMMIT,
                             "check out fdebc938 (v0.5.16); never the 0.5.17 dev-preview"))
        else:
            out.append(_ok("sglang.commit", f"git HEAD {f.git_commit[:12]} at {f.sglang_root}"))
        if f.git_dirty:
            out.append(_fail("sglang.tree_clean", f"{len(f.git_dirty)} modified files under {f.sglang_root}/python "
                             f"(e.g. {f.git_dirty[0]})", "the untouched 0.5.16 tree",
                             "restore it (git checkout -- python); dsv4-sm80 patches at runtime only"))
    if f.fingerprint_mismatch:
        rel, what = next(iter(f.fingerprint_mismatch.items()))
        out.append(_fail("sglang.fingerprint", f"{len(f.fingerprint_mismatch)} of {len(upstream.FINGERPRINTS)} "
                         f"fingerprinted files differ (e.g. {rel}: {what})", f"the files of {want}",
                         "use the untouched v0.5.16 tree; a modified or other-version SGLang cannot take the seams"))
    else:
        out.append(_ok("sglang.fingerprint", f"{len(upstream.FINGERPRINTS)} files match {want}"))
    return out


def _lab_value(lab, name):
    v = lab.get(name)
    return None if v is None else v.strip()


def check_gpus(f: GpuFacts, lab: dict) -> list[Finding]:
    want_count, want_cc = 4, "8.0"
    lab_count, lab_cc = _lab_value(lab, env.LAB_GPU_COUNT.name), _lab_value(lab, env.LAB_CC.name)
    fix_lab = "run on 4 x A800/A100 80GB (SM80)"
    out = []
    if lab_count is not None:
        if not lab_count.isdigit() or int(lab_count) < 1:
            return [_fail("gpu.count", f"{env.LAB_GPU_COUNT.name}={lab_count!r}", "a positive integer", "fix the lab override")]
        want_count = int(lab_count)
    if lab_cc is not None:
        want_cc = lab_cc
    devs = f.devices
    desc = ": " + ", ".join(f"{d['name']} (cc {d['cc']})" for d in devs) if devs else ""
    suffix = f" ({f.error})" if f.error else ""
    if len(devs) != want_count:
        out.append(_fail("gpu.count", f"{len(devs)} visible GPUs{suffix}{desc}",
                         f"exactly {want_count}" + ("" if lab_count else " (4 x A800 80GB, tensor parallel 4)"),
                         f"{fix_lab}; CUDA_VISIBLE_DEVICES must list exactly four" if not lab_count else "check the lab machine"))
    else:
        out.append(_ok("gpu.count", f"{len(devs)} visible GPUs{desc}"))
    if not devs:
        out.append(_skip("gpu.capability", "no GPU"))
        out.append(_skip("gpu.memory", "no GPU"))
        return out
    bad = [d for d in devs if d["cc"] != want_cc]
    if bad:
        out.append(_fail("gpu.capability", f"compute capability {', '.join(sorted({d['cc'] for d in bad}))} "
                         f"on {len(bad)} GPU(s) ({bad[0]['name']})", f"every GPU {want_cc}" + ("" if lab_cc else " (SM80: A800/A100)"),
                         f"{fix_lab}; SM90+ GPUs should run native SGLang ({env.PATCH.name}=0)" if not lab_cc else "check the lab machine"))
    else:
        out.append(_ok("gpu.capability", f"all {want_cc}"))
    small = [d for d in devs if d["memory_gib"] < A800_MIN_MEMORY_GIB]
    if small:
        out.append(_fail("gpu.memory", f"{small[0]['memory_gib']} GiB on {small[0]['name']}",
                         f">= {A800_MIN_MEMORY_GIB} GiB per GPU (weights alone are ~39 GiB per GPU at TP4)",
                         "use 80 GB cards"))
    else:
        out.append(_ok("gpu.memory", f"min {min(d['memory_gib'] for d in devs)} GiB"))
    return out


def check_env_knobs(knobs: Optional[dict]) -> Finding:
    """Every dsv4-sm80 knob the launch sees holds one of its documented values (README "Environment")."""
    if knobs is None:
        return _skip("env.knobs", "not collected")
    for knob in env.KNOBS:
        try:
            env.get(knob, knobs)
        except env.EnvError:
            return _fail("env.knobs", f"{knob.name}={knobs.get(knob.name)!r}", f"one of {', '.join(knob.choices)}: "
                         f"{knob.doc}", f"set {knob.name} to one of {', '.join(knob.choices)}, or unset it for "
                         f"{knob.default!r}")
    return _ok("env.knobs", f"{len(knobs)} set, all within their values")


def check_jit_cache(dirs: Optional[list]) -> list[Finding]:
    """Each JIT cache directory writable, with room on its disk: a cold start compiles into them, and a
    disk that fills half-way fails deep inside a compiler."""
    if dirs is None:
        return [_skip("jit.cache", "not collected")]
    out, need = [], jitcache.MIN_FREE_BYTES
    for d in dirs:
        var = d.label[d.label.find("(") + 1:d.label.find(")")] if "(" in d.label else "its cache variable"
        if not d.writable:
            out.append(_fail("jit.cache", f"{d.label} at {d.path}: not writable ({d.error or 'no write access'})",
                             "a writable cache directory", f"fix its permissions, or set {var} to a writable directory"))
        elif d.free_bytes is not None and d.free_bytes < need:
            out.append(_fail("jit.cache", f"{d.label} at {d.path}: {jitcache.gib(d.free_bytes)} free on its disk",
                             f">= {jitcache.gib(need)} free (a cold start compiles kernels into it)",
                             f"free space there, or set {var} to a disk with room"))
    if not out:
        free = min((d.free_bytes for d in dirs if d.free_bytes is not None), default=None)
        cold = [d for d in dirs if d.ours_built is False]
        missing = [m for d in dirs for m in (d.modules_missing or [])]
        note = ("; this path's Triton kernels are not built here yet: the first requests compile them (minutes; "
                "SGLang's --watchdog-timeout, 300 s, counts them: README, first start)") if cold else ""
        if missing:
            note += (f"; SGLang's JIT modules {', '.join(missing)} are not built here yet: the first forward builds "
                     "them (minutes; under the same watchdog)")
        out.append(_ok("jit.cache", f"{len(dirs)} cache directories writable, least free {jitcache.gib(free)}{note}"))
    return out


MIN_NVCC_TEXT = ".".join(map(str, jitcache.MIN_NVCC))


def check_jit_compiler(n: Optional[jitcache.NvccFacts]) -> Finding:
    """The nvcc SGLang's JIT builds run (jitcache.nvcc_facts): present and a release TileLang's C++20 builds
    accept; otherwise the first build (the mHC prewarm, while loading) fails half-way into the start."""
    if n is None:
        return _skip("jit.compiler", "not collected")
    want = (f"nvcc {MIN_NVCC_TEXT}+ (SGLang's JIT kernels, the TileLang mHC kernels and FlashInfer's sampling "
            "compile for sm_80 at first use)")
    if n.path is None or n.version is None:
        return _fail("jit.compiler", f"{n.error} (looked up via {n.how})", want,
                     "install the CUDA toolkit (SGLang's image has it at /usr/local/cuda) or set CUDA_HOME to it")
    if tuple(int(x) for x in n.version.split(".")) < jitcache.MIN_NVCC:
        return _fail("jit.compiler", f"nvcc {n.version} at {n.path} ({n.how})", want,
                     f"point CUDA_HOME at a CUDA {MIN_NVCC_TEXT}+ toolkit")
    return _ok("jit.compiler", f"nvcc {n.version} at {n.path} ({n.how})")


def check_patch(f: PatchFacts) -> Finding:
    want = f"{env.PATCH.name}=1 and dsv4-sm80's sitecustomize with its seam finder installed"
    if f.env_value.strip() != "1":
        return _fail("patch.active", f"{env.PATCH.name}={f.env_value!r} in {f.where}", want,
                     f"export {env.PATCH.name}=1 (0 runs SGLang natively, which has no SM80 datapath for DSV4)")
    if not f.ours:
        return _fail("patch.active", f"sitecustomize {f.sitecustomize} in {f.where} is not dsv4-sm80's", want,
                     "put the overlay directory first on PYTHONPATH "
                     "(/sgl-workspace/platform:/sgl-workspace/sm80-patch:/sgl-workspace/sglang/python)")
    if f.error or not f.hook_installed:
        return _fail("patch.active", f"the patch did not install in {f.where}: {f.error or 'no seam finder'}", want,
                     "fix the reported error (see the dsv4-sm80 line printed at interpreter start)")
    return _ok("patch.active", f"{f.where}: {f.sitecustomize}")


def check_sglang_knobs(f: PatchFacts) -> Finding:
    """The import-time SGLang knobs the SM80 datapath needs (env.IMPORT_TIME_DEFAULTS): sitecustomize
    sets them where unset; a user value that differs would put an SM90-only kernel on the path."""
    if f.env_value.strip() != "1" or not f.hook_installed:
        return _skip("patch.sglang_knobs", "patch not active")
    bad = [d for d in env.IMPORT_TIME_DEFAULTS if f.knobs.get(d.name) != d.value]
    if bad:
        d = bad[0]
        return _fail("patch.sglang_knobs", f"{d.name}={f.knobs.get(d.name)!r} in {f.where}",
                     f"{d.name}={d.value} ({d.reason})", f"unset {d.name} (dsv4-sm80 sets it) or set it to {d.value}")
    return _ok("patch.sglang_knobs", ", ".join(f"{d.name}={d.value}" for d in env.IMPORT_TIME_DEFAULTS))


def check_model_config(m: ModelFacts) -> list[Finding]:
    if not m.path:
        return [_skip("model.path", "no model path given")]
    if not m.is_dir:
        return [_fail("model.path", f"{m.path} is not a directory", "a local checkpoint directory",
                      f"download {OFFICIAL} and pass its directory")]
    if m.config is None:
        return [_fail("model.config", f"config.json unreadable ({m.config_error})", "the checkpoint's config.json",
                      f"use {OFFICIAL}")]
    out = [_ok("model.config", os.path.join(m.path, "config.json"))]
    arch, mt = m.config.get("architectures"), m.config.get("model_type")
    out.append(_ok("model.architecture", str(arch)) if arch == ["DeepseekV4ForCausalLM"] else
               _fail("model.architecture", str(arch), "['DeepseekV4ForCausalLM']",
                     "dsv4-sm80 serves DeepSeek-V4-Flash / -Vision-Exp only"))
    out.append(_ok("model.model_type", mt) if mt == "deepseek_v4" else
               _fail("model.model_type", repr(mt), "'deepseek_v4'",
                     "V4.1 (deepseek_v41) and converted configs are not supported; use " + OFFICIAL))
    return out


def is_loopback(host: Optional[str]) -> bool:
    h = (host or "127.0.0.1").strip().strip("[]").lower()
    return h in ("localhost", "::1", "ip6-localhost") or h.startswith("127.")


def check_bind(host: Optional[str], has_api_key: bool, environ=None) -> Finding:
    """A patched server on a non-loopback address needs --api-key, or the logged opt-out
    DSV4_SM80_ALLOW_OPEN_BIND=1. Never sees or prints the key itself, only whether one is set."""
    host = host or "127.0.0.1"
    if is_loopback(host):
        return _ok("server.bind", f"{host} (loopback)")
    if has_api_key:
        return _ok("server.bind", f"{host} with an API key (requests without it are rejected)")
    if env.get(env.ALLOW_OPEN_BIND, environ) == "1":
        return _ok("server.bind", f"{host} WITHOUT an API key ({env.ALLOW_OPEN_BIND.name}=1): anyone who can "
                                  "reach this port can use the model")
    return _fail("server.bind", f"--host {host} (not loopback) without --api-key",
                 "--api-key KEY for any address other than loopback",
                 f"add --api-key (clients send 'Authorization: Bearer KEY'), bind 127.0.0.1, or set "
                 f"{env.ALLOW_OPEN_BIND.name}=1 to serve it open on purpose")


# SGLang modes that change how DSV4's attention or experts are scheduled and that the SM80 datapath has never
# run (no CPU test, no lab run): refused with the patch on rather than served unverified. (attribute, flag,
# what it does); each is off by default in SGLang 0.5.16 for DSV4.
UNVERIFIED_MODES = (
    ("enable_dp_attention", "--enable-dp-attention", "data-parallel attention (gathered batches, padded metadata)"),
    ("enable_two_batch_overlap", "--enable-two-batch-overlap", "two-batch overlap (an expert-parallel schedule)"),
    ("enable_single_batch_overlap", "--enable-single-batch-overlap", "single-batch overlap (expert-parallel)"),
    ("enable_hierarchical_cache", "--enable-hierarchical-cache", "KV pages offloaded to host memory"),
    ("enable_hisparse", "--enable-hisparse", "hierarchical sparse attention: a host-offloaded DSV4 pool with its "
                                             "own layout and transfer kernels, never adapted to the BF16 KV cache "
                                             "(SGLang's own HiSparse check passes at launch: the dtype is still FP8)"),
    ("enable_pdmux", "--enable-pdmux", "prefill/decode multiplexing on split SMs"),
    ("enable_mixed_chunk", "--enable-mixed-chunk", "decode tokens mixed into prefill batches"),
    ("enable_torch_compile", "--enable-torch-compile", "torch.compile over the model, the SM80 seams and Triton "
                                                       "kernels inside it"),
    ("disaggregation_mode", "--disaggregation-mode", "prefill/decode disaggregation (KV pages sent between "
                                                     "servers in the native layout)"),
    ("pp_size", "--pp-size", "pipeline parallelism (this path has run tensor parallelism only)"),
    ("nnodes", "--nnodes", "more than one node (the gate checks one host's 4 GPUs; nothing multi-node has run)"),
    ("dp_size", "--dp-size", "data-parallel replicas (a DP controller over several TP groups)"),
    ("enable_lora", "--enable-lora", "LoRA adapters (their kernels around the SM80 linears)"),
    ("lora_paths", "--lora-paths", "LoRA adapters (their kernels around the SM80 linears)"),
    ("enable_deterministic_inference", "--enable-deterministic-inference",
     "deterministic inference (SGLang swaps attention and reduction kernels for batch-invariant ones)"),
    ("enable_eplb", "--enable-eplb", "expert-parallel load balancing"),
    ("enable_dp_lm_head", "--enable-dp-lm-head", "a data-parallel LM head"),
)
COUNT_MODES = ("pp_size", "nnodes", "dp_size")  # refused above 1, named with their value


def _mode_on(attr: str, value) -> bool:
    if attr == "disaggregation_mode":
        return value not in (None, "null", "none")
    if attr in COUNT_MODES:
        return int(value or 1) > 1
    return bool(value)


def check_modes(server_args) -> Finding:
    """The modes in UNVERIFIED_MODES, with the patch on: any one set is refused, naming its flag."""
    on = []
    for attr, flag, what in UNVERIFIED_MODES:
        value = getattr(server_args, attr, None)
        if _mode_on(attr, value):
            on.append((f"{flag} {value}" if attr == "disaggregation_mode" or attr in COUNT_MODES else flag, what))
    if not on:
        return _ok("server.modes", "none of the unverified SGLang modes")
    return _fail("server.modes", "; ".join(f"{flag} ({what})" for flag, what in on),
                 "none of " + ", ".join(flag for _, flag, _ in UNVERIFIED_MODES) + " (the SM80 datapath has not "
                 "run them)", "drop " + ", ".join(flag.split()[0] for flag, _ in on))


EAGLE_LIKE = ("EAGLE", "EAGLE3", "NEXTN")


def check_speculative(algorithm: Optional[str], m: ModelFacts) -> Finding:
    """`--speculative-algorithm NEXTN/EAGLE` needs a V3-style MTP layer (`mtp.N.e_proj`/`h_proj`, the
    original V4-Flash release). The 0731 and Vision-Exp releases carry a DSPARK draft instead; NextN on
    them builds its projections from nothing and runs on uninitialised weights (accept rate 0, slower
    than no speculation) without any error. Refused here, before SGLang starts."""
    algo = (algorithm or "").upper()
    if algo not in EAGLE_LIKE:
        return _ok("speculative.draft", algo or "no speculative decoding")
    if m.index is None:
        return _skip("speculative.draft", f"{algo}: needs the checkpoint index to find its draft weights")
    names = m.index["weight_map"]
    has_nextn = any(n.startswith("mtp.") and (".e_proj." in n or ".h_proj." in n) for n in names)
    if has_nextn:
        return _ok("speculative.draft", f"{algo}: the checkpoint has MTP e_proj/h_proj")
    dspark = any(n.startswith("mtp.") for n in names)
    return _fail("speculative.draft",
                 f"--speculative-algorithm {algo} on a checkpoint without mtp.*.e_proj / h_proj"
                 + (" (it carries a DSPARK draft: the 0731 / Vision-Exp releases)" if dspark else ""),
                 "a V3-style MTP layer for NEXTN/EAGLE (it would run on uninitialised weights: accept rate 0)",
                 "use --speculative-algorithm DSPARK" if dspark else "drop --speculative-algorithm")


def check_model_files(m: ModelFacts) -> list[Finding]:
    names = ("model.quantization_config", "model.index", "model.shards", "model.keys",
             "model.dense_fp8", "model.experts", "model.vision", "model.tensors")
    if not m.path or not m.is_dir or m.config is None:
        return [_skip(n, "needs a readable model directory") for n in names]
    out = []
    q = m.config.get("quantization_config") or {}
    want_q = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    bad_q = {k: q.get(k) for k, v in want_q.items() if q.get(k) != v}
    out.append(_ok("model.quantization_config", "fp8 e4m3, ue8m0, [128, 128]") if not bad_q else
               _fail("model.quantization_config", f"{bad_q}", str(want_q),
                     f"the config was altered (converted checkpoint?); use {OFFICIAL}"))
    if m.index is None:
        out.append(_fail("model.index", f"model.safetensors.index.json unreadable ({m.index_error})",
                         "the index with a weight_map", f"re-download {OFFICIAL}"))
        return out + [_skip(n, "needs the index") for n in names[2:]]
    wm = m.index["weight_map"]
    out.append(_ok("model.index", f"{len(wm)} tensors in {len(set(wm.values()))} shards"))
    shard_problems = dict(m.shard_errors)
    for shard, h in m.headers.items():
        if h.file_size < h.expected_file_size:
            shard_problems[shard] = f"truncated: {h.file_size} bytes, header needs {h.expected_file_size}"
        elif h.file_size > h.expected_file_size:
            shard_problems[shard] = f"{h.file_size} bytes, header describes {h.expected_file_size}"
    actual = {}
    for name, shard in wm.items():
        h = m.headers.get(shard)
        if h is None:
            continue
        t = h.tensors.get(name)
        if t is None:
            shard_problems.setdefault(shard, f"index lists {name} but the shard does not hold it")
            continue
        actual[name] = (t["dtype"], tuple(t["shape"]))
    for shard, h in m.headers.items():
        for name, t in h.tensors.items():
            actual.setdefault(name, (t["dtype"], tuple(t["shape"])))
    if shard_problems:
        shard, why = sorted(shard_problems.items())[0]
        out.append(_fail("model.shards", f"{len(shard_problems)} bad shard file(s): {shard}: {why}",
                         "every shard named by the index present and complete",
                         "re-download the named file(s) and verify them against the hub's sha256"))
        return out + [_skip(n, "needs every shard complete") for n in names[3:]]
    out.append(_ok("model.shards", f"{len(m.headers)} shards complete"))
    try:
        specs = fmt.inventory(m.config)
    except fmt.FormatError as e:
        out.append(_fail("model.keys", f"config cannot describe a DSV4 checkpoint: {e}", "the official config.json",
                         f"use {OFFICIAL}"))
        return out + [_skip(n, "needs the key inventory") for n in names[4:]]
    out += _compare_inventory(specs, actual, fmt.has_vision(m.config))
    return out


def _compare_inventory(specs, actual: dict, vision: bool) -> list[Finding]:
    expected = {s.name: s for s in specs}
    missing = [s for s in specs if s.name not in actual]
    extra = [n for n in actual if n not in expected]
    wrong = [(s, actual[s.name]) for s in specs if s.name in actual and actual[s.name] != (s.dtype, s.shape)]

    def family(check, families, noun, wrong_phrase, want, fix, ok_text):
        """One check over a tensor family: the first re-typed/reshaped tensor, else the first missing."""
        miss = [s for s in missing if s.family in families]
        bad = [(s, g) for s, g in wrong if s.family in families]
        if bad:
            s, g = bad[0]
            return _fail(check, f"{len(bad)} {noun} tensors {wrong_phrase} (e.g. {s.name} {g[0]} {list(g[1])}, "
                                f"expected {s.dtype} {list(s.shape)})", want, fix)
        if miss:
            return _fail(check, f"{len(miss)} {noun} tensors missing (e.g. {miss[0].name})", want, fix)
        return _ok(check, ok_text)

    def count(fam_name):
        return sum(s.family == fam_name for s in specs)

    out = []
    # keys: names that are not the native scheme, missing or unknown (structure, not dtype)
    vision_extra = [n for n in extra if n.startswith(("vision.", "aligner.", "image_")) or n.endswith(".bias_vl")]
    other_extra = [n for n in extra if n not in vision_extra]
    core_missing = [s for s in missing if s.family == fmt.PLAIN]
    if other_extra or core_missing:
        bits = []
        if other_extra:
            bits.append(f"{len(other_extra)} unexpected keys (e.g. {sorted(other_extra)[0]})")
        if core_missing:
            bits.append(f"{len(core_missing)} keys missing (e.g. {core_missing[0].name})")
        hf = any(n.startswith("model.layers.") or n.endswith("weight_scale_inv") for n in other_extra)
        out.append(_fail("model.keys", "; ".join(bits) + (" - HF-style names: a converted checkpoint" if hf else ""),
                         f"the {len(specs)} native keys the config implies (embed.weight, layers.N.attn.wq_a.weight, ...)",
                         f"use {OFFICIAL}; never a converted one"))
    else:
        out.append(_ok("model.keys", f"{len(specs)} native keys"))

    # dense FP8 block linears; the community converter's signature is named as such
    dense_want = "F8_E4M3 weight + F8_E8M0 scale [ceil(out/128), ceil(in/128)] for every dense linear"
    dense_fix = f"use {OFFICIAL}: dsv4-sm80 dequantizes to BF16 at load, it never needs converted weights"
    converted = [(s, g) for s, g in wrong if s.family == fmt.FP8_WEIGHT and g[0] in ("BF16", "F16", "F32")
                 and s.name[:-len(".weight")] + ".scale" not in actual]
    if converted:
        s, g = converted[0]
        out.append(_fail("model.dense_fp8", f"{len(converted)} FP8 linears stored as {g[0]} without their .scale "
                         f"(e.g. {s.name} {g[0]} {list(g[1])}): a converted checkpoint", dense_want, dense_fix))
    else:
        out.append(family("model.dense_fp8", {fmt.FP8_WEIGHT, fmt.FP8_SCALE}, "dense FP8", "with another dtype/shape",
                          dense_want, dense_fix, f"{count(fmt.FP8_WEIGHT)} FP8 block linears"))

    out.append(family("model.experts", {fmt.EXPERT_WEIGHT, fmt.EXPERT_SCALE}, "expert", "re-typed or reshaped",
                      "MXFP4 as shipped: I8 [out, in/2] + F8_E8M0 [out, in/32]",
                      f"use {OFFICIAL}; experts stay 4-bit and are widened in the kernel",
                      f"{count(fmt.EXPERT_WEIGHT)} MXFP4 expert weights"))

    if vision:
        out.append(family("model.vision", {fmt.VISION}, "vision", "altered",
                          "every vision.*, aligner.*, image_* tensor BF16 as shipped (+ F32 bias_vl)",
                          f"use {OFFICIAL}; the text-only converter drops or corrupts vision tensors",
                          f"{count(fmt.VISION)} vision-side tensors"))
    elif vision_extra:
        out.append(_fail("model.vision", f"{len(vision_extra)} vision tensors (e.g. {vision_extra[0]}) but no vision_* fields in config.json",
                         "vision_* config fields with vision tensors (Vision-Exp) or neither (Flash)",
                         f"the config was altered; use {OFFICIAL}"))
    else:
        out.append(_skip("model.vision", "text-only checkpoint"))

    # remaining tensors (BF16 / F32 / I64 as shipped); missing ones are model.keys' finding
    p_wrong = [(s, g) for s, g in wrong if s.family == fmt.PLAIN]
    if p_wrong:
        s, g = p_wrong[0]
        out.append(_fail("model.tensors", f"{len(p_wrong)} tensors with another dtype/shape (e.g. {s.name} {g[0]} {list(g[1])})",
                         f"as shipped (e.g. {s.name} {s.dtype} {list(s.shape)})", f"use {OFFICIAL}"))
    else:
        out.append(_ok("model.tensors", "BF16 / F32 / I64 tensors as shipped"))
    return out


def evaluate(facts: Facts) -> list[Finding]:
    """Every check, in the gate's order: compatibility first, then the model files."""
    return (check_sglang(facts.sglang) + check_gpus(facts.gpus, facts.lab) + [check_env_knobs(facts.knobs)]
            + check_jit_cache(facts.jit) + [check_jit_compiler(facts.nvcc)]
            + check_model_config(facts.model) + [check_patch(facts.patch), check_sglang_knobs(facts.patch)]
            + check_model_files(facts.model))


# --- report ------------------------------------------------------------------------------------

class GateRefused(RuntimeError):
    """The gate failed; the message holds one line per failed check."""


def failures(findings) -> list[Finding]:
    return [f for f in findings if f.status == "fail"]


def report(facts: Facts, findings, as_json=False) -> str:
    if as_json:
        return json.dumps({
            "ok": not failures(findings),
            "lab_overrides": facts.lab,
            "checks": [asdict(f) for f in findings],
            "facts": {
                "sglang": asdict(facts.sglang), "gpus": asdict(facts.gpus), "patch": asdict(facts.patch),
                "model": {"path": facts.model.path, "shards_read": len(facts.model.headers),
                          "architectures": (facts.model.config or {}).get("architectures")},
                "jit_caches": [asdict(d) for d in facts.jit] if facts.jit is not None else None,
                "nvcc": asdict(facts.nvcc) if facts.nvcc is not None else None,
            },
        }, indent=2)
    lines = [f.line() for f in findings]
    bad = failures(findings)
    lines.append(f"gate: {'REFUSED, ' + str(len(bad)) + ' check(s) failed' if bad else 'passed'}")
    return "\n".join(lines)


def banner_once(stream=sys.stderr):
    b = env.lab_banner()
    if b:
        print(b, file=stream, flush=True)


def run(model_path=None, patch_environ=None, as_json=False, stream=sys.stdout) -> int:
    banner_once()
    facts = collect(model_path, patch_environ)
    findings = evaluate(facts)
    print(report(facts, findings, as_json), file=stream, flush=True)
    return 1 if failures(findings) else 0


def run_sglang_only(as_json=False, stream=sys.stdout) -> int:
    """Only the SGLang checks (version, location, commit, clean tree, fingerprint): what docker/build.sh
    asks of a base image before building on it; no GPU, patch or model facts are collected."""
    facts = collect_sglang()
    findings = check_sglang(facts)
    bad = failures(findings)
    if as_json:
        print(json.dumps({"ok": not bad, "checks": [asdict(f) for f in findings], "sglang": asdict(facts)}, indent=2),
              file=stream, flush=True)
    else:
        lines = [f.line() for f in findings] + [f"gate (sglang only): {'REFUSED' if bad else 'passed'}"]
        print("\n".join(lines), file=stream, flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="compat_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sglang-only", action="store_true", help="only the SGLang checks (for image builds)")
    args = ap.parse_args(argv)
    if args.sglang_only:
        return run_sglang_only(as_json=args.json)
    return run(args.model_path, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
