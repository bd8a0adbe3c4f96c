"""The launch stage: what a start of SGLang needs on SM80, in one place.

- `gate_and_set_args` (seam `launch.gate`, before `Engine._launch_subprocesses`): the one path by which
  `sglang.Engine` and `python -m sglang.launch_server` (so `serve` too) start their schedulers. The gate judges
  SGLang's parsed server arguments, so a PYTHONPATH-injected SGLang refuses exactly as `serve` does; then the launch
  sets what the stages' rules (`seams.SERVER_ARGS`: the MoE runner backend, the KV cache dtype) and the
  interconnect (SGLang's custom all-reduce off unless NVLink joins every pair of GPUs) call for, before the scheduler
  processes receive the arguments.
- `load_jit_naming_a_full_disk` (seam `launch.jit_disk_full`, around SGLang's `load_jit`): a cold start compiles
  SGLang's JIT modules into TVM_FFI_CACHE_DIR; a build that fails on a full disk becomes `jitcache.JitCacheFull`,
  naming the module, the directory, the free space and the fix, instead of a compiler or ninja error.
- `log_footprint` (seam `launch.footprint`, after `ModelRunner.init_cuda_graphs`): one line per GPU and model once
  everything is allocated, to compare with docs/footprint.md.
- `first_start_args`: on a cold host `serve` (and the container entrypoint) raises SGLang's scheduler watchdog for
  the first start, which compiles for minutes.
"""

from __future__ import annotations

import os
import sys

from ..footprint import GIB, VISION_PREFIXES

# --- the gate and the server arguments -------------------------------------------------------------------


def gate_and_set_args(cls, server_args, *args, **kwargs):
    """Before Engine._launch_subprocesses (srt/entrypoints/engine.py:765): refuse, or set the arguments the facts
    and the stages' rules call for and say what changed."""
    from .. import gate

    facts, findings = gate.run_gate(server_args.model_path, tokenizer=gate.tokenizer_wanted(server_args),
                                    server_args=server_args)
    if gate.failures(findings):
        raise gate.refusal(findings)
    changed = []
    for attr, value in gate.launch_settings(facts, server_args).items():
        was = getattr(server_args, attr, None)
        if was != value:
            setattr(server_args, attr, value)
            changed.append(f"{attr} {was} -> {value}")
    if changed:
        print(f"dsv4-sm80 launch: {', '.join(changed)}", file=sys.stderr, flush=True)
    for f in findings:
        if f.status == "warn" or (f.check == "server.bind" and "WITHOUT" in f.found):
            print(f"dsv4-sm80: {f.line()}", file=sys.stderr, flush=True)
    return None


# --- a cold start's JIT builds ---------------------------------------------------------------------------

def load_jit_naming_a_full_disk(original, *args, **kwargs):
    """Around sglang.jit_kernel.utils.compile.load_jit: the same call; a failure caused by a full disk
    (ENOSPC/EDQUOT anywhere in the exception chain, or the compiler's "No space left on device") becomes
    JitCacheFull with the module, the directory and the free space."""
    from ..jitcache import disk_full, disk_full_error

    try:
        return original(*args, **kwargs)
    except Exception as e:
        if not disk_full(e):
            raise
        module = "_".join(str(a) for a in args) or "?"
        where = str(kwargs.get("build_directory") or os.path.expanduser(os.environ.get("TVM_FFI_CACHE_DIR")
                                                                          or "~/.cache/tvm-ffi"))
        raise disk_full_error(f"building SGLang JIT module {module!r}", where,
                              "TVM_FFI_CACHE_DIR (and TRITON_CACHE_DIR)", e) from e


FIRST_START_WATCHDOG_S = 1800


def first_start_args(rest: list, environ=None) -> tuple:
    """(rest, note): on a host whose Triton cache holds none of this path's kernels (jitcache.ours_built) or whose
    SGLang JIT (tvm-ffi) cache is empty or lacks a module the configured modes build at their first forward
    (jitcache.FIRST_FORWARD_MODULES), SGLang's scheduler watchdog (300 s) would kill the first forward while it
    compiles, so --watchdog-timeout FIRST_START_WATCHDOG_S is added for this start, with a note saying so. A user's
    own --watchdog-timeout always wins; a warm cache changes nothing."""
    from .. import jitcache
    from ..gate.argv import flag_value

    if flag_value(rest, "--watchdog-timeout") is not None:
        return rest, None
    cold = jitcache.cold_reasons(environ)
    if not cold:
        return rest, None
    return [*rest, "--watchdog-timeout", str(FIRST_START_WATCHDOG_S)], (
        f"serve: first start on this host ({'; '.join(cold)}): the first forward compiles for minutes, so "
        f"SGLang's scheduler watchdog is {FIRST_START_WATCHDOG_S} s for this start (--watchdog-timeout to choose; "
        "keep the cache directories to start warm next time; `python -m dsv4_sm80 prebuild-jit` builds SGLang's JIT "
        "modules ahead, several at a time)")


# --- the start-up footprint: what one GPU holds once SGLang allocated everything -------------------------

RUNTIME_VISION_PREFIXES = ("vision_part.", *VISION_PREFIXES)  # the VL class holds them under vision_part.


def _unique_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        try:
            storage = t.untyped_storage()
            key = (storage.device.type, storage.device.index, storage.data_ptr())
        except Exception:
            continue
        if key in seen or storage.data_ptr() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def tensors_of(obj, depth: int = 3, _visited=None):
    """Every torch tensor reachable from obj's attributes (lists, tuples, dicts, nested objects) up to depth."""
    import torch

    _visited = set() if _visited is None else _visited
    if id(obj) in _visited or depth < 0:
        return
    _visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, (list, tuple, set)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)) and \
            type(obj).__module__.split(".")[0] in ("sglang", "dsv4_sm80"):
        items = vars(obj).values()
    else:
        return
    for x in items:
        yield from tensors_of(x, depth - 1, _visited)


def model_bytes(model) -> dict:
    """Bytes of a model's parameters and buffers (unique storages), split into vision and the rest."""
    seen: set = set()
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    vision = _unique_bytes((t for n, t in named if n.startswith(RUNTIME_VISION_PREFIXES)), seen)
    rest = _unique_bytes((t for _, t in named), seen)
    return {"weights": rest, "vision": vision}


def _size(n: int) -> str:
    """GiB, or MiB below a tenth of one (a small vision tower printed 0.00 GiB on the H200)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


def startup_line(runner) -> str:
    """One line for one ModelRunner after its CUDA graphs: weights, vision, KV pool, graphs, free memory."""
    import torch

    role = "draft" if getattr(runner, "is_draft_worker", False) else "target"
    m = model_bytes(runner.model)
    pool = getattr(runner, "token_to_kv_pool", None)
    kv = _unique_bytes(tensors_of(pool), set()) if pool is not None else 0
    # SGLang's own figure: free memory before minus after the capture in units of 2^30 bytes (utils/common.py
    # get_available_gpu_memory), which its log labels "GB"
    graphs = float(getattr(runner, "graph_mem_usage", 0.0) or 0.0)
    parts = [f"weights {m['weights'] / GIB:.2f} GiB" + (f" (+ vision {_size(m['vision'])})" if m["vision"] else ""),
             f"KV pool {kv / GIB:.2f} GiB ({getattr(runner, 'max_total_num_tokens', 0):,} tokens)",
             f"CUDA graphs {graphs:.2f} GiB"]
    ws = expand_workspace(runner)
    if ws:
        parts.append(ws)
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        parts.append(f"free {free / GIB:.2f} of {total / GIB:.2f} GiB")
    rank = getattr(getattr(runner, "ps", None), "tp_rank", getattr(runner, "tp_rank", 0))
    return f"[rank {rank}] dsv4-sm80 footprint ({role}): " + ", ".join(parts)


def expand_workspace(runner) -> str:
    """The W4A8 MoE's expanded-path workspace (`mxfp4_int8`, layers whose every column is shiftable): a transient of
    a MoE call, not a resident, allocated only by forwards above 8192 tokens, which SGLang's chunked prefill size
    bounds; "" when no layer can take that path."""
    from .moe import w4a8_layer

    layer = next((m for m in runner.model.modules() if getattr(w4a8_layer(m), "expand_ok", False)), None)
    if layer is None:
        return ""
    from ..kernels.w4a8_moe import EXPAND_TOKENS, expand_share

    e, two_i, half_h = layer.w13_weight.shape  # repacked codes: two per byte along the hidden size
    _, ws_bytes, ok_bytes = expand_share(e, two_i, 2 * half_h)
    chunk = int(getattr(getattr(runner, "server_args", None), "chunked_prefill_size", 0) or 0)
    if 0 < chunk <= EXPAND_TOKENS:
        reach = f"not reached: chunked prefill {chunk:,}"
    else:
        chunking = f"chunked prefill {chunk:,}" if chunk > 0 else "chunked prefill off"
        reach = f"reached by prefill forwards above {EXPAND_TOKENS:,} tokens ({chunking})"
    return f"MoE expand workspace {_size(ws_bytes + ok_bytes)} transient, {reach}"


def log_footprint(result, runner, *args, **kwargs):
    """After ModelRunner.init_cuda_graphs (model_runner.py:838): the start-up footprint of this GPU, one line
    per model (target, then a draft). A report, never a reason to fail a start: errors are printed instead."""
    try:
        line = startup_line(runner)
    except Exception as e:  # diagnostics only
        line = f"dsv4-sm80 footprint: not available ({type(e).__name__}: {e})"
    print(line, file=sys.stderr, flush=True)
    return None
