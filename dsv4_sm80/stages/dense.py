"""Dense linears on SM80: FP8 block weights become BF16 at load (default), or stay FP8 through
SGLang 0.5.16's own FP8-Marlin W8A16 path (`SGLANG_DSV4_A100_DENSE=fp8_marlin`).

SM80 has no FP8 tensor cores. Every non-expert linear of DSV4 is F8_E4M3 with one UE8M0 scale per
128x128 block; e4m3 (4 significant bits) times a power of two is exact in BF16 (8 significant bits)
as long as the product is a BF16 normal or subnormal, so the conversion is lossless and runs on the
GPU, per module, right after its weights load (each TP rank converts only its shard, the FP8 tensor
is dropped as it goes). The seams that route DSV4's linears here are declared in `seams.py`
(stage "dense"); this file holds their replacements.

Which linears: every `Fp8LinearMethod` DSV4 builds - fused `wqkv_a` (or `wq_a` + `wkv`), `wq_b`,
`wo_b`, the shared experts, the indexer's `wq_b`, the DSPARK draft's linears - plus `wo_a`, which
DSV4 consumes through an einsum on `weight.view(G, R, D)` rather than through its quant method
(deepseek_v4.py:1265), and `main_proj`, which must end BF16 and never be re-quantized (a
re-quantized `main_proj` drops DSPARK acceptance to ~0 while outputs still look right). Those two
are BF16 in both modes.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import env

BLOCK = 128
ALWAYS_BF16_SUFFIXES = ("wo_a", "main_proj")


class DenseLoadError(RuntimeError):
    """A dense FP8 linear cannot be converted (e.g. its scale was never loaded)."""


def to_bf16_blocks(weight: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Exact dequantization of an FP8 block-quantized weight: bf16(fp32(w) * scale[i // 128, j // 128]).

    weight: float8_e4m3fn [N, K]; scale: float32 or float8_e8m0fnu [ceil(N/128), ceil(K/128)] holding
    powers of two. The fp32 product is exact (4 significant bits times a power of two, from
    2^-136 up), so the single rounding to BF16 is the only one: it is exact wherever the value is a
    BF16 normal or subnormal, as the checkpoint's values are.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected a float8_e4m3fn weight, got {weight.dtype}")
    n, k = weight.shape
    want = (-(-n // block), -(-k // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {n}x{k}: expected {want}")
    s = scale.to(torch.float32)
    if n % block == 0 and k % block == 0:
        w = weight.to(torch.float32).view(want[0], block, want[1], block)
        return (w * s[:, None, :, None]).view(n, k).to(torch.bfloat16)
    full = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (weight.to(torch.float32) * full).to(torch.bfloat16)


# --- load-time bookkeeping (progress lines and the summary) -------------------------------------

@dataclass
class _Stats:
    tensors: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    layer: str = ""
    marlin: int = 0
    by_layer: dict = field(default_factory=dict)


_stats = _Stats()
_LAYER_RE = re.compile(r"((?:layers|stages|decoder)\.\d+)")


def _layer_of(prefix: str) -> str:
    m = _LAYER_RE.search(prefix)
    return m.group(1) if m else "model"


def _progress(prefix: str, before: int, after: int) -> None:
    layer = _layer_of(prefix)
    if layer != _stats.layer and _stats.layer:
        _log_layer(_stats.layer)
    _stats.layer = layer
    t, b, a = _stats.by_layer.get(layer, (0, 0, 0))
    _stats.by_layer[layer] = (t + 1, b + before, a + after)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _say(line: str, every_rank: bool = False) -> None:
    """Load-time lines go to stderr directly: SGLang's logging setup does not cover our logger."""
    if every_rank or _rank() == 0:
        print(line if not every_rank else f"[rank {_rank()}] {line}", file=sys.stderr, flush=True)


def _log_layer(layer: str) -> None:
    t, b, a = _stats.by_layer[layer]
    _say(f"dsv4-sm80 dense: {layer}: {t} linears FP8 -> BF16 ({b / 2**20:.1f} -> {a / 2**20:.1f} MiB)")


def load_summary() -> str:
    s = _stats
    text = (f"dsv4-sm80 dense ({env.get(env.DENSE)}): {s.tensors} FP8 block linears converted to BF16 "
            f"({s.bytes_before / 2**30:.3f} GiB -> {s.bytes_after / 2**30:.3f} GiB) in {s.seconds:.2f} s")
    if s.marlin:
        text += f"; {s.marlin} kept FP8 through SGLang's FP8-Marlin W8A16"
    return text


# --- the linear method ---------------------------------------------------------------------------

@functools.cache
def _method_class():
    """Built lazily: the base class lives in sglang, which may only be imported once SGLang is."""
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

    class Sm80Bf16LinearMethod(Fp8LinearMethod):
        """Loads the checkpoint's FP8 block weight and scale unchanged (Fp8LinearMethod.create_weights),
        then replaces them with the exact BF16 weight; forward is a BF16 GEMM."""

        def __init__(self, quant_config, prefix: str = ""):
            super().__init__(quant_config)
            self.use_marlin = False
            self.prefix = prefix

        def process_weights_after_loading(self, layer) -> None:
            t0 = time.perf_counter()
            weight, scale = layer.weight.data, layer.weight_scale_inv.data
            if scale.dtype == torch.float32 and bool((scale == torch.finfo(torch.float32).min).any()):
                raise DenseLoadError(
                    f"dsv4-sm80 dense: {self.prefix or type(layer).__name__}: weight_scale_inv was never "
                    "loaded (its .scale tensor is missing from the checkpoint); refusing to run on garbage"
                )
            bf16 = to_bf16_blocks(weight, scale)
            before = weight.numel() * weight.element_size() + scale.numel() * scale.element_size()
            layer.weight = torch.nn.Parameter(bf16, requires_grad=False)
            del layer.weight_scale_inv
            layer.input_scale = None
            _stats.tensors += 1
            _stats.bytes_before += before
            _stats.bytes_after += bf16.numel() * 2
            _stats.seconds += time.perf_counter() - t0
            _progress(self.prefix, before, bf16.numel() * 2)

        def apply(self, layer, x, bias=None):
            return F.linear(x, layer.weight, bias)

    return Sm80Bf16LinearMethod


def sm80_bf16_method(quant_config, prefix: str = ""):
    return _method_class()(quant_config, prefix)


# --- seam replacements -------------------------------------------------------------------------

def select_quant_method(original, self, layer, prefix):
    """Around Fp8Config.get_quant_method (fp8.py:336): route every FP8 block linear to the SM80 choice.

    bf16: Sm80Bf16LinearMethod. fp8_marlin: SGLang's own Fp8LinearMethod with Marlin W8A16, which
    0.5.16 auto-enables on SM80-88 (fp8.py:438-444) - forced here so a lab run on SM90 takes the
    path an A800 takes; its DeepGEMM runner is unset so no UE8M0 requant (fp8.py:648) touches the
    scales Marlin reads. wo_a and main_proj are BF16 in both modes.
    """
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

    method = original(self, layer, prefix)
    if type(method) is not Fp8LinearMethod or not method.block_quant:
        return method
    if env.get(env.DENSE) == "bf16" or prefix.endswith(ALWAYS_BF16_SUFFIXES):
        return sm80_bf16_method(self, prefix)
    method.use_marlin = True
    method.w8a8_block_fp8_linear = None
    _stats.marlin += 1
    return method


def with_sm80_loader_name(names):
    """Value of linear.WEIGHT_LOADER_V2_SUPPORTED (linear.py:58): SGLang's list plus the SM80 method,
    which creates its parameters with Fp8LinearMethod.create_weights and so needs the same loader."""
    return list(names) if "Sm80Bf16LinearMethod" in names else [*names, "Sm80Bf16LinearMethod"]


def marlin_reduce_as_sm80(should_use_atomic_add_reduce):
    """Value of marlin_utils_fp8.should_use_atomic_add_reduce (the name apply_fp8_marlin_linear calls,
    marlin_utils_fp8.py:75): the upstream rule as SM8x evaluates it. Upstream lets Marlin sum its
    split-K partials with BF16 atomicAdd when n < 2048 <= k, but only on capability >= 9
    (marlin_utils.py:479-483); an A800 reduces in fp32, and a lab run on an H200 must too: the BF16 sums move
    wo_b (n 512, k 2048) well past BF16 rounding (docs/results/README.md). FP16 keeps the upstream answer (SM8x
    takes atomicAdd for FP16 too)."""
    if getattr(should_use_atomic_add_reduce, "_dsv4_sm80", False):
        return should_use_atomic_add_reduce

    @functools.wraps(should_use_atomic_add_reduce)
    def as_sm80(m, n, k, device, dtype):
        if dtype == torch.bfloat16:
            return False
        return should_use_atomic_add_reduce(m, n, k, device, dtype)

    as_sm80._dsv4_sm80 = True
    return as_sm80


def build_wo_a_from_checkpoint(original, self, *args, **kwargs):
    """Around MqaAttentionBase.__init__ (deepseek_v4.py:378): build `wo_a` with the checkpoint's FP8
    quant config so each TP rank loads its FP8 shard and converts it on the GPU, instead of the
    CPU-side dequantization of the whole unsharded tensor in every rank (deepseek_v4.py:2731-2738,
    also forced for the DSPARK draft at deepseek_v4_dspark.py:94). `wo_a_fp8` stays False, so the
    forward keeps its BF16 einsum (deepseek_v4.py:1265), never DeepGEMM."""
    quant_config = kwargs["quant_config"] if "quant_config" in kwargs else (args[2] if len(args) > 2 else None)
    if quant_config is not None and getattr(quant_config, "weight_block_size", None):
        kwargs["wo_a_keeps_quant_config"] = True
        kwargs["wo_a_fp8"] = False
    return original(self, *args, **kwargs)


def keep_wo_a_fp8_for_gpu(weights):
    """Replaces deepseek_v4._dequant_fp8_wo_a (deepseek_v4.py:3112): wo_a's FP8 weight and scale now
    load into an FP8 parameter pair (see build_wo_a_from_checkpoint), so pass them through."""
    return weights


def dense_inventory(model) -> list[dict]:
    """Every linear of `model` that has a quant method and a `weight`: its method, weight dtype,
    and resident bytes (weight plus any scale). Fused MoE layers hold `w13_weight`/`w2_weight`
    instead and are the MoE stage's business."""
    rows = []
    for name, mod in model.named_modules():
        method, weight = getattr(mod, "quant_method", None), getattr(mod, "weight", None)
        if method is None or not isinstance(weight, torch.Tensor):
            continue
        nbytes = sum(t.numel() * t.element_size() for attr in ("weight", "weight_scale_inv", "weight_scale")
                     if isinstance(t := getattr(mod, attr, None), torch.Tensor))
        rows.append({"name": name, "method": type(method).__name__,
                     "marlin": bool(getattr(method, "use_marlin", False)),
                     "dtype": str(weight.dtype).removeprefix("torch."), "shape": list(weight.shape),
                     "bytes": nbytes})
    return rows


def off_path(rows: list[dict]) -> list[dict]:
    """Linears left where an A800 cannot run them: an FP8 weight not repacked for Marlin, or an
    Fp8LinearMethod that would call SGLang's native FP8 GEMM (DeepGEMM/CUTLASS, SM89+)."""
    return [r for r in rows if r["dtype"].startswith("float8")
            or (r["method"] == "Fp8LinearMethod" and not r["marlin"])]


def check_dense_state(model) -> list[dict]:
    rows = dense_inventory(model)
    bad = off_path(rows)
    if bad:
        names = ", ".join(f"{r['name']} ({r['method']}, {r['dtype']})" for r in bad[:4])
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise DenseLoadError(
            f"dsv4-sm80 dense.state: found {len(bad)} linear(s) on SGLang's native FP8 path after loading "
            f"{type(model).__name__}: {names}{more}; expected every FP8 block linear BF16 "
            f"(SGLANG_DSV4_A100_DENSE=bf16) or FP8-Marlin W8A16 (fp8_marlin); fix: this SGLang build "
            "constructs a linear the seam table does not route - report it with this line"
        )
    return rows


def _write_report(model, rows: list[dict], summary: str) -> None:
    path = env.get(env.LOAD_REPORT)
    if not path:
        return
    import json

    line = {"rank": _rank(), "model": type(model).__name__, "dense": env.get(env.DENSE),
            "summary": summary, "linears": rows}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def log_load_summary(result, model, *args, **kwargs):
    """After DefaultModelLoader.load_weights_and_postprocess (loader.py:804), once per model (the
    target, then a speculative draft): refuse if any linear is left on the native FP8 path, print
    the one-line summary with the dense bytes now resident, and start counting afresh."""
    global _stats
    if _stats.layer:
        _log_layer(_stats.layer)
    rows = check_dense_state(model)
    resident = sum(r["bytes"] for r in rows if r["method"] in ("Sm80Bf16LinearMethod", "Fp8LinearMethod"))
    summary = (f"{load_summary()}; FP8-checkpoint linears resident {resident / 2**30:.3f} GiB "
               f"({type(model).__name__})")
    _say(summary, every_rank=True)
    _write_report(model, rows, summary)
    _stats = _Stats()
    return result
