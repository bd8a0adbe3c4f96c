"""The gate's facts, collected once: SGLang, the GPUs, the patch, the knobs, the JIT caches and the
checkpoint on disk. Collectors record what they find (a parse error, a missing or unreadable file)
as data and never raise; every judgement is in `checks` / `model_checks`.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from .. import env, jitcache, upstream

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# What SGLang's tokenizer load (transformers' AutoTokenizer) reads from the checkpoint folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_TOKENIZER_FILES = ("special_tokens_map.json",)
MAX_HEADER = 100 << 20  # the safetensors library's own limit on the header length


@dataclass
class SGLangFacts:
    location: str | None = None
    version: str | None = None
    sglang_root: str | None = None  # SGLANG_ROOT when it is a git tree
    under_root: bool = False  # the imported package lives in SGLANG_ROOT/python
    git_commit: str | None = None
    git_dirty: list | None = None  # modified tracked files under python/ (None: git unavailable)
    fingerprint_mismatch: dict = field(default_factory=dict)


@dataclass
class GpuFacts:
    devices: list = field(default_factory=list)  # [{"index", "name", "cc", "memory_gib"}]
    error: str | None = None


@dataclass
class InterconnectFacts:
    """NVLink between the visible GPUs, read from NVML the way SGLang decides whether its custom all-reduce may
    run (srt/distributed/device_communicators/custom_all_reduce_utils.py:352-391, `is_full_nvlink`)."""
    gpus: int = 0
    pairs: list = field(default_factory=list)  # [{"a", "b", "nvlink"}] over visible GPU indices, a < b
    links: list = field(default_factory=list)  # active NVLinks per visible GPU
    error: str | None = None  # NVML could not answer: the interconnect is unknown


@dataclass
class PatchFacts:
    where: str = "this interpreter"
    env_value: str = ""
    sitecustomize: str | None = None
    ours: bool = False
    hook_installed: bool = False
    error: str | None = None
    knobs: dict = field(default_factory=dict)  # the import-time SGLang knobs, as that process sees them


@dataclass
class FileFact:
    """One file of the checkpoint folder as the loader would meet it."""
    name: str
    kind: str  # file | missing | directory | special | denied | unreadable
    size: int = 0
    detail: str = ""  # what stands there (special), or the OS error (denied, unreadable)


@dataclass
class JsonFact:
    file: FileFact
    value: Any = None
    error: str | None = None  # the file is there but is not JSON


@dataclass
class HeaderFact:
    """A safetensors shard's header, unjudged: `entries` is the JSON object as (key, value) pairs
    (duplicates kept), or None with `error` saying why the header is no JSON object."""
    file: FileFact
    header_len: int = 0
    entries: list | None = None
    error: str | None = None


@dataclass
class ModelFacts:
    path: str | None = None
    is_dir: bool = False
    path_kind: str = ""  # what stands at path when it is no directory
    config: JsonFact | None = None
    index: JsonFact | None = None
    shards: dict = field(default_factory=dict)  # index file name -> HeaderFact (names that stay in the folder)
    tokenizer: dict = field(default_factory=dict)  # file name -> JsonFact
    tokenizer_load_error: str | None = None  # the tokenizers library's own parse of tokenizer.json
    tokenizer_wanted: bool = True  # False: the server runs with --skip-tokenizer-init or another tokenizer
    error: str | None = None  # the collector itself failed (reported as a FAIL line, never raised)

    @property
    def config_dict(self) -> dict | None:
        v = self.config.value if self.config else None
        return v if isinstance(v, dict) else None

    @property
    def weight_map(self) -> dict | None:
        v = self.index.value if self.index else None
        wm = v.get("weight_map") if isinstance(v, dict) else None
        return wm if isinstance(wm, dict) else None


@dataclass
class Facts:
    sglang: SGLangFacts
    gpus: GpuFacts
    patch: PatchFacts
    model: ModelFacts
    lab: dict = field(default_factory=dict)
    jit: list | None = None  # [jitcache.CacheDirFacts]; None: not collected
    knobs: dict | None = None  # dsv4-sm80's own env knobs as the launch sees them; None: not collected
    nvcc: jitcache.NvccFacts | None = None  # None: not collected
    interconnect: InterconnectFacts | None = None  # None: not collected


# --- SGLang, GPUs, patch --------------------------------------------------------------------------

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
            bus = ctypes.create_string_buffer(32)
            cu.cuDeviceGetPCIBusId(bus, 32, d)
            out["devices"].append({"index": i, "name": name.value.decode(errors="replace"),
                                   "cc": "%d.%d" % (major.value, minor.value),
                                   "memory_gib": round(mem.value / 2**30, 1),
                                   "pci_bus_id": bus.value.decode(errors="replace")})
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


def collect_interconnect(gpus: GpuFacts, nvml=None) -> InterconnectFacts:
    """NVLink or not between each pair of the visible GPUs (`gpus`, matched to NVML by PCI bus id, so
    CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER apply), in this process: NVML creates no CUDA context. `nvml`
    is the pynvml module (nvidia-ml-py, what SGLang itself imports); an error leaves the interconnect unknown."""
    if gpus.error or not gpus.devices:
        return InterconnectFacts(error=gpus.error or "no visible GPU")
    f = InterconnectFacts(gpus=len(gpus.devices))
    if any(not d.get("pci_bus_id") for d in gpus.devices):
        f.error = "the GPU probe gave no PCI bus id to find the GPUs in NVML by"
        return f
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception as e:
        f.error = f"NVML unavailable ({type(e).__name__}: {e})"
        return f
    try:
        handles = [nvml.nvmlDeviceGetHandleByPciBusId(d["pci_bus_id"]) for d in gpus.devices]
        index = [d["index"] for d in gpus.devices]
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                f.pairs.append({"a": index[i], "b": index[j], "nvlink": _nvlink(nvml, handles[i], handles[j])})
        f.links = [_active_links(nvml, h) for h in handles]
    except Exception as e:
        f.pairs, f.links, f.error = [], [], f"NVML query failed ({type(e).__name__}: {e})"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # the answer is already read
            pass
    return f


def _nvlink(nvml, a, b) -> bool:
    """SGLang's own test (custom_all_reduce_utils.py:380-390): P2P over NVLink reported OK; an NVML error
    (what a GPU without NVLink may answer) counts as no NVLink."""
    try:
        return nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK
    except nvml.NVMLError:
        return False


def _active_links(nvml, handle) -> int:
    """The GPU's active NVLinks. Counted per GPU, not per pair: behind an NVSwitch a link's far end is the switch."""
    n = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            n += nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED
        except nvml.NVMLError:  # past the GPU's last link, or no NVLink at all
            break
    return n


def collect_patch_here() -> PatchFacts:
    f = PatchFacts(env_value=os.environ.get(env.PATCH.name, ""))
    mod = sys.modules.get("sitecustomize")
    f.sitecustomize = getattr(mod, "__file__", None)
    state = getattr(mod, "DSV4_SM80_STATE", False)
    f.ours = state is not False
    if isinstance(state, dict):
        f.error = state.get("error")
    from .. import apply

    f.hook_installed = apply.installed()
    f.knobs = {d.name: os.environ.get(d.name) for d in env.IMPORT_TIME_DEFAULTS}
    return f


_PATCH_PROBE = ("import dataclasses, json; from dsv4_sm80.gate import facts; "
                "print(json.dumps(dataclasses.asdict(facts.collect_patch_here())))")


def collect_patch_in(environ: dict) -> PatchFacts:
    """Whether a Python process started with `environ` (the one `serve` launches) gets the patch:
    the same collection as for this interpreter, run in such a process."""
    where = "the launch environment"
    try:
        r = subprocess.run([sys.executable, "-c", _PATCH_PROBE], env=environ, capture_output=True, text=True,
                           timeout=120)
        return PatchFacts(**dict(json.loads(r.stdout.strip().splitlines()[-1]), where=where))
    except Exception as e:
        detail = r.stderr.strip()[-300:] if "r" in locals() else f"{type(e).__name__}: {e}"
        return PatchFacts(where=where, env_value=environ.get(env.PATCH.name, ""), error=f"probe failed: {detail}")


# --- the checkpoint folder --------------------------------------------------------------------------

_SPECIAL = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
            (stat.S_ISSOCK, "a socket"))


def file_fact(folder: str, name: str) -> FileFact:
    path = os.path.join(folder, name)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return FileFact(name, "missing")
    except PermissionError as e:
        return FileFact(name, "denied", detail=f"PermissionError: {e.strerror}")
    except OSError as e:
        return FileFact(name, "unreadable", detail=f"{type(e).__name__}: {e.strerror or e}")
    if stat.S_ISDIR(st.st_mode):
        return FileFact(name, "directory")
    if not stat.S_ISREG(st.st_mode):
        what = next((w for test, w in _SPECIAL if test(st.st_mode)), "no regular file")
        return FileFact(name, "special", detail=what)
    if not os.access(path, os.R_OK):
        return FileFact(name, "denied", st.st_size, "PermissionError: no read permission")
    return FileFact(name, "file", st.st_size)


def _read_error(f: FileFact, e: OSError) -> None:
    f.kind = "denied" if isinstance(e, PermissionError) else "unreadable"
    f.detail = f"{type(e).__name__}: {e.strerror or e}"


def _pairs_hook(dups: list):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                dups.append(k)
            out[k] = v
        return out
    return hook


def read_json(folder: str, name: str) -> JsonFact:
    f = file_fact(folder, name)
    out = JsonFact(f)
    if f.kind != "file":
        return out
    try:
        with open(os.path.join(folder, name), "rb") as fh:
            raw = fh.read()
    except OSError as e:
        _read_error(f, e)
        return out
    try:
        out.value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        out.error = f"not UTF-8 text ({e.reason} at byte {e.start})"
    except ValueError as e:
        out.error = f"not JSON ({e})"
    except RecursionError:
        out.error = "not JSON (nested too deeply)"
    return out


def read_header(folder: str, name: str) -> HeaderFact:
    """The raw safetensors header: 8-byte little-endian length N, then N bytes of JSON."""
    f = file_fact(folder, name)
    h = HeaderFact(f)
    if f.kind != "file":
        return h
    try:
        with open(os.path.join(folder, name), "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                h.error = f"{f.size} bytes, too short for a safetensors header"
                return h
            (n,) = struct.unpack("<Q", head)
            h.header_len = n
            if n > MAX_HEADER or 8 + n > f.size:
                h.error = f"header length {n} does not fit in a {f.size}-byte file (limit {MAX_HEADER})"
                return h
            raw = fh.read(n)
    except OSError as e:
        _read_error(f, e)
        return h
    if not raw.startswith(b"{"):
        h.error = "header JSON is not an object (it does not start with '{')"
        return h
    dups: list = []
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs_hook(dups))
    except UnicodeDecodeError as e:
        h.error = f"header is not UTF-8 ({e.reason} at byte {e.start})"
        return h
    except ValueError as e:
        h.error = f"header is not JSON ({e})"
        return h
    except RecursionError:
        h.error = "header is not JSON (nested too deeply)"
        return h
    # a tensor name given twice shows twice (json keeps the last); repeats inside an entry are its own problem
    h.entries = list(value.items()) + [(k, None) for k in dups if k in value]
    return h


def index_name_problem(name) -> str | None:
    """SGLang keeps the `*.safetensors` files of the model folder that the index names
    (weight_utils.filter_duplicate_safetensors_files): anything else in the index is never loaded."""
    if not isinstance(name, str):
        return f"{name!r} is a {type(name).__name__}, not a file name"
    if not name or os.path.isabs(name) or "/" in name or "\\" in name or name in (".", ".."):
        return f"{name!r} is not a file name inside the model folder"
    if not name.endswith(".safetensors"):
        return f"{name!r} is not a .safetensors file"
    return None


def tokenizer_wanted(server_args) -> bool:
    """Whether SGLang will load the checkpoint folder's own tokenizer."""
    if getattr(server_args, "skip_tokenizer_init", False):
        return False
    tok = getattr(server_args, "tokenizer_path", None)
    model = getattr(server_args, "model_path", None)
    return tok is None or model is None or os.path.abspath(tok) == os.path.abspath(model)


def collect_model(path: str | None, tokenizer: bool = True) -> ModelFacts:
    f = ModelFacts(path=path, tokenizer_wanted=tokenizer)
    try:
        _collect_model(f)
    except Exception as e:  # reported by the model checks as their FAIL line
        f.error = f"{type(e).__name__}: {e}"
    return f


def _collect_model(f: ModelFacts) -> None:
    path = f.path
    if not path:
        return
    top = file_fact(os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path)))
    f.is_dir = top.kind == "directory"
    if not f.is_dir:
        f.path_kind = top.detail if top.kind in ("special", "denied", "unreadable") else top.kind
        return
    f.config = read_json(path, CONFIG)
    f.index = read_json(path, INDEX)
    for shard in sorted({s for s in (f.weight_map or {}).values() if index_name_problem(s) is None}):
        f.shards[shard] = read_header(path, shard)
    if f.tokenizer_wanted:
        for name in TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES:
            f.tokenizer[name] = read_json(path, name)
        tj = f.tokenizer["tokenizer.json"]
        if tj.error is None and isinstance(tj.value, dict):
            f.tokenizer_load_error = _tokenizers_parse(os.path.join(path, "tokenizer.json"))


def _tokenizers_parse(path: str) -> str | None:
    """The tokenizers library's own reading of tokenizer.json (what the server's tokenizer load runs)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        Tokenizer.from_file(path)
    except BaseException as e:  # a Rust panic arrives as pyo3's PanicException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return None


def collect(model_path: str | None = None, patch_environ: dict | None = None, tokenizer: bool = True) -> Facts:
    environ = patch_environ if patch_environ is not None else os.environ
    gpus = collect_gpus()
    return Facts(
        sglang=collect_sglang(),
        gpus=gpus,
        patch=collect_patch_in(patch_environ) if patch_environ is not None else collect_patch_here(),
        model=collect_model(model_path, tokenizer),
        interconnect=collect_interconnect(gpus),
        lab=env.lab_overrides(),
        jit=jitcache.facts(patch_environ),
        nvcc=jitcache.nvcc_facts(patch_environ),
        knobs={k.name: v for k in env.KNOBS if (v := environ.get(k.name)) is not None},
    )
