"""The environment contract of dsv4-sm80, in one place.

Nothing here imports torch or sglang: `sitecustomize` reads this module in every Python process
before SGLang is imported (SGLang spawns its schedulers, so each one is a fresh interpreter that
runs `sitecustomize` again).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

SGLANG_VERSION = "0.5.16"
SGLANG_COMMIT = "fdebc938f7f4d16fe6b9f55dcd9a767cf0899ea1"


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    choices: tuple[str, ...]
    doc: str


class EnvError(ValueError):
    """An env knob holds a value outside its contract."""


# The user-facing contract (README "Environment").
PATCH = Knob(
    "ENABLE_SGLANG_DSV4_A100_PATCH", "0", ("0", "1"),
    "1: apply the SM80 datapath when SGLang imports its modules. 0 or unset: do nothing at all "
    "(native SGLang, for A/B).",
)
INT8_INDEXER = Knob(
    "SGLANG_DSV4_A100_INT8_INDEXER", "1", ("1",),
    "1: the C4 indexer cache is INT8 (128 codes and an fp32 row scale, or under "
    "SGLANG_DSV4_A100_INDEXER_ROUNDING=fp4_sim the 4 power-of-two exponents of its 32-wide blocks). It is the only "
    "indexer cache the SM80 path has (SGLang's is FP8, which SM80 cannot run; no BF16 indexer is built), so 0 is "
    "refused.",
)
KV_ROUNDING = Knob(
    "SGLANG_DSV4_A100_KV_ROUNDING", "none", ("none", "fp8_sim"),
    "Attention KV cache rows: none = the BF16 row as computed; fp8_sim = the model's own FP8 simulation "
    "(DeepSeek-V4's inference code applies it, and the model was trained with it) on every stored window and "
    "compressed key row: its 448 non-rope dims in blocks of 64 with a power-of-two scale, rounded to e4m3 on the "
    "BF16 row; the 64 rope dims untouched. Exact in BF16: same pool, no extra memory, one extra pass only over "
    "the compressed rows. The default stays none until it is measured against the reference on a GPU "
    "(docs/attention.md).",
)
INDEXER_ROUNDING = Knob(
    "SGLANG_DSV4_A100_INDEXER_ROUNDING", "int8", ("int8", "fp4_sim"),
    "C4 indexer query and keys after the Hadamard rotation: int8 = INT8 per row with an fp32 scale; fp4_sim = "
    "the model's own FP4 simulation (blocks of 32, power-of-two scales, e2m1), held exactly as INT8 codes with "
    "per-block exponents in the same 132-byte cache entries, the logits on INT8 tensor cores per block. The "
    "default stays int8 until it is measured against the reference on a GPU (docs/attention.md).",
)
MOE_BACKEND = Knob(
    "SGLANG_DSV4_MXFP4_MOE_BACKEND", "mxfp4_int8", ("mxfp4_int8", "marlin"),
    "Routed experts: mxfp4_int8 = 4-bit resident, INT8 tensor cores (W4A8); "
    "marlin = SGLang's MXFP4 Marlin W4A16 with the SM90 refusal lifted.",
)
DENSE = Knob(
    "SGLANG_DSV4_A100_DENSE", "bf16", ("bf16", "fp8_marlin"),
    "Dense FP8 block linears: bf16 = dequantized exactly to BF16 at load, BF16 tensor cores; "
    "fp8_marlin = kept 1 byte/weight through SGLang's FP8-Marlin W8A16 (wo_a, main_proj stay BF16).",
)
SGLANG_ROOT = Knob(
    "SGLANG_ROOT", "/sgl-workspace/sglang", (),
    "The SGLang 0.5.16 git tree of the official image; read by the gate, never written.",
)

# Lab overrides: the only way to pass the gate on GPUs other than 4 x SM80. Never defaults;
# every start that sees one prints a banner (see `lab_banner`).
LAB_GPU_COUNT = Knob(
    "DSV4_SM80_LAB_GPU_COUNT", "", (),
    "Lab only: accept this many visible GPUs instead of 4.",
)
LAB_CC = Knob(
    "DSV4_SM80_LAB_CC", "", (),
    "Lab only: accept GPUs of this compute capability (e.g. 9.0 for the H200 test bed) "
    "instead of 8.0. The SM80 datapath is still the one that runs.",
)

LOAD_REPORT = Knob(
    "DSV4_SM80_LOAD_REPORT", "", (),
    "Diagnostics: after each model loads, append its dense-linear inventory (one JSON line per "
    "rank and model: module, method, dtype, bytes) to this file.",
)

ALLOW_OPEN_BIND = Knob(
    "DSV4_SM80_ALLOW_OPEN_BIND", "0", ("0", "1"),
    "1: let the patched server bind a non-loopback address without --api-key (logged at every start). "
    "0: such a start is refused.",
)

VISION = Knob(
    "DSV4_SM80_VISION", "0", ("0", "1"),
    "Experimental: 1 installs the Vision-Exp backport (VL model class, image processor, bias_vl routing, the "
    "bidirectional image window in the SM80 attention, prefill chunks cut only at image-block edges); with "
    "ENABLE_SGLANG_DSV4_A100_PATCH=0 the overlay alone on native SGLang (for A/B). "
    "0: not installed.",
)

# The lab switch: 1 lets the laboratory (the separate `dsv4_lab` package, never in the image) add its seams after
# the product's; product code learns of the lab only through it (`apply.lab_seams`).
LAB = Knob(
    "DSV4_SM80_LAB", "0", ("0", "1"),
    "Lab only: 1 applies the lab's seams (dsv4_lab/seams.py: native-rounding replay, tripwire, page poisoning, "
    "memory log, route trace) after the product's; needs the dsv4_lab package on the path. Never for serving.",
)

KNOBS = (PATCH, INT8_INDEXER, KV_ROUNDING, INDEXER_ROUNDING, MOE_BACKEND, DENSE, SGLANG_ROOT, LAB_GPU_COUNT, LAB_CC,
         LOAD_REPORT, ALLOW_OPEN_BIND, VISION, LAB)


def get(knob: Knob, environ: Mapping[str, str] | None = None) -> str:
    """The knob's value, its default when unset or empty; EnvError outside its choices."""
    environ = os.environ if environ is None else environ
    raw = environ.get(knob.name, "")
    value = raw.strip() or knob.default
    if knob.choices and value not in knob.choices:
        raise EnvError(
            f"{knob.name}={raw!r} is not one of {', '.join(knob.choices)}: {knob.doc}"
        )
    return value


def patch_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return get(PATCH, environ) == "1"


def lab_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return get(LAB, environ) == "1"


_lab_knobs: tuple[Knob, ...] = ()


def lab_knobs() -> tuple[Knob, ...]:
    """The lab's knobs, once the applier has taken the lab's seam table (`apply.lab_seams`); () otherwise."""
    return _lab_knobs


def use_lab_knobs(knobs) -> None:
    global _lab_knobs
    _lab_knobs = tuple(knobs)


def lab_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k.name: environ[k.name] for k in (LAB_GPU_COUNT, LAB_CC) if environ.get(k.name, "").strip()}


def lab_banner(environ: Mapping[str, str] | None = None) -> str | None:
    overrides = lab_overrides(environ)
    switch = (environ if environ is not None else os.environ).get(LAB.name, "").strip() == "1"
    if not overrides and not switch:
        return None
    items = ", ".join(f"{k}={v}" for k, v in {**overrides, **({LAB.name: "1"} if switch else {})}.items())
    what = ("The GPU gate is overridden for a test bed" if overrides else "The lab's seams are applied")
    bar = "!" * 100
    return (
        f"{bar}\n!!! dsv4-sm80 LAB MODE: {items}\n"
        f"!!! {what}. This is not a supported A800 deployment;\n"
        "!!! numbers measured here are not A800 numbers.\n"
        f"{bar}"
    )


@dataclass(frozen=True)
class ImportTimeDefault:
    name: str
    value: str
    reason: str
    # a guard: the value is SGLang's own default; pinned only so a user setting cannot put an SM90-only or
    # bypassing kernel on the path (the gate refuses it). Native runs the same with or without it.
    guard: bool = False


# SGLang knobs that must hold before SGLang's modules are imported, set by `sitecustomize` only
# where the user has not set them. Lines are sglang 0.5.16's.
IMPORT_TIME_DEFAULTS = (
    ImportTimeDefault(
        "SGLANG_OPT_FP8_WO_A_GEMM", "0",
        "srt/models/deepseek_v4.py:196 captures it at import; the FP8 wo_a einsum is DeepGEMM (SM90+)",
    ),
    ImportTimeDefault(
        "SGLANG_OPT_USE_TOPK_V2", "0",
        "srt/environ.py:1057; top-k v2 launches thread-block clusters (sm_90+, topk_v2.cuh:34)",
    ),
    ImportTimeDefault(
        "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", "0",
        "srt/environ.py:1022; FlashMLA sparse prefill ships sm_90a/sm_100a code only",
    ),
    ImportTimeDefault(
        "SGLANG_OPT_DSV4_NONPAGED_INDEXER", "0",
        "srt/environ.py:1010; the non-paged indexer calls DeepGEMM fp8_mqa_logits (SM90+)",
    ),
    ImportTimeDefault(
        "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH", "1",
        "srt/layers/attention/dsv4/indexer.py:640 and metadata.py:124; routes the indexer logits to the module "
        "global the attention.indexer_logits seam replaces (INT8) and keeps DeepGEMM metadata unbuilt",
    ),
    ImportTimeDefault(
        "SGLANG_OPT_USE_ONLINE_COMPRESS", "0",
        "srt/environ.py:1015; pinned off: the SM80 compressor stores follow the offline path", guard=True,
    ),
    # guards (SGLang's defaults), from a read of the whole forward (docs/attention.md, kernel status)
    ImportTimeDefault(
        "SGLANG_OPT_USE_TILELANG_MHC_PRE", "1",
        "srt/environ.py:1003; mHC pre-mix through TileLang kernels built for sm_80 and the mhc.hc_prenorm_gemm "
        "seam; off selects TileLang kernels not checked for sm_80", guard=True,
    ),
    ImportTimeDefault(
        "SGLANG_OPT_USE_TILELANG_MHC_POST", "1",
        "srt/environ.py:1004; mHC post-mix: the TileLang kernel built for sm_80", guard=True,
    ),
    ImportTimeDefault(
        "SGLANG_OPT_DEEPGEMM_HC_PRENORM", "1",
        "srt/environ.py:1002; routes mhc_pre's GEMM to deep_gemm_wrapper (seam mhc.hc_prenorm_gemm); off selects "
        "TileLang GEMMs built only for hc x hidden 16384/28672", guard=True,
    ),
    ImportTimeDefault(
        "SGLANG_OPT_FUSE_MHC_POST_PRE", "0",
        "srt/environ.py:1007; on, kernels/ops/layernorm/mhc.py:1448 calls deep_gemm.tf32_hc_prenorm_gemm "
        "itself (SM90+), past the mhc.hc_prenorm_gemm seam", guard=True,
    ),
    ImportTimeDefault(
        "SGLANG_OPT_BF16_FP32_GEMM_ALGO", "cublas",
        "srt/environ.py:1080; deep_gemm makes jit_kernel/dsv4/gemm.py (router, compressor scores) call DeepGEMM "
        "(SM90+; below SM90 the wrapper has no deep_gemm: NameError)", guard=True,
    ),
    ImportTimeDefault(
        "SGLANG_OPT_USE_TILELANG_INDEXER", "0",
        "srt/environ.py:1008; on, indexer.py:634 takes TileLang's FP8 paged logits before the INT8 seam, reading "
        "the INT8 index cache as FP8", guard=True,
    ),
    ImportTimeDefault(
        "SGLANG_OPT_USE_AITER_INDEXER", "0",
        "srt/environ.py:1009; on, indexer.py:637 takes AITER's logits (ROCm) before the INT8 seam", guard=True,
    ),
)


# SGLang's own knob the vision overlay sets (when unset) on native SGLang, patch off: the native image window
# needs the FlashMLA prefill that reads the metadata's SWA lists (vision_backport/window.py).
NATIVE_VISION_PREFILL = ImportTimeDefault(
    "SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", "0",
    "srt/layers/attention/deepseek_v4_backend.py:1695-1710: on (its default) every extend takes the sparse "
    "prefill branch, which builds its SWA indices without the image block",
)


def apply_import_time_defaults(environ=None) -> dict[str, str]:
    """Set each default the user has not set; return what was set."""
    environ = os.environ if environ is None else environ
    applied = {}
    for d in IMPORT_TIME_DEFAULTS:
        if d.name not in environ:
            environ[d.name] = d.value
            applied[d.name] = d.value
    return applied
