"""The lab's seam table: what a lab run adds on top of the product's seams, declared as the product declares its
own (`dsv4_sm80.seams.Seam`, overlay "lab") and applied by the product's one applier (`dsv4_sm80.apply`) after
the product's seams on the same target, only with DSV4_SM80_LAB=1. Each lab seam on a product target wraps the
product's replacement (kind `around`), so the product's stage files hold no lab branch.
"""

from __future__ import annotations

from dsv4_sm80 import env
from dsv4_sm80.seams import Seam

from .knobs import LAB_KNOBS

env.use_lab_knobs(LAB_KNOBS)  # lab seams' toggles name these

PATCH_ON = "ENABLE_SGLANG_DSV4_A100_PATCH=1"


def _lab(name: str, target: str, kind: str, replacement: str, reason: str, upstream: str, *when: str) -> Seam:
    return Seam(name=f"lab.{name}", target=target, kind=kind, replacement=replacement, reason=reason,
                upstream=upstream, when=when, overlay="lab")


def _tripwire(name: str, target: str, reason: str, upstream: str, *when: str) -> Seam:
    """`target` replaced by dsv4_lab.tripwire:`name`, a function that raises."""
    return Seam(name=f"tripwire.{name}", target=target, kind="replace", replacement=f"dsv4_lab.tripwire:{name}",
                reason=reason, upstream=upstream, when=(PATCH_ON, "DSV4_SM80_TRIPWIRE=1", *when), overlay="lab")


_INDEXER = "sglang.srt.layers.attention.dsv4.indexer"

# tripwire (tripwire.py): SM90/SM100-only entry points raise, naming themselves
TRIPWIRE = (
    _tripwire("fp8_k_pack", "sglang.srt.layers.attention.deepseek_v4_backend:quant_to_nope_fp8_rope_bf16_pack_triton",
              "Triton float8e4nv K packer of the FP8 store path; never on the SM80 path.",
              "srt/layers/attention/deepseek_v4_backend.py:29"),
    _tripwire("fp8_k_dequant", "sglang.srt.layers.attention.deepseek_v4_backend:dequantize_k_cache_paged",
              "Triton float8e4nv dequantization feeding FlashMLA sparse prefill.",
              "srt/layers/attention/deepseek_v4_backend.py:23"),
    _tripwire("topk_v2", f"{_INDEXER}:topk_transform_512_v2",
              "The cluster top-k (sm_90+); SGLANG_OPT_USE_TOPK_V2=0 keeps v1.",
              "srt/layers/attention/dsv4/indexer.py:13"),
    _tripwire("deepgemm_linear",
              "sglang.srt.layers.quantization.fp8_utils:deepgemm_w8a8_block_fp8_linear_with_fallback",
              "DeepGEMM FP8 block GEMM (native dense path on SM90).",
              "srt/layers/quantization/fp8_utils.py:787"),
    _tripwire("cutlass_linear", "sglang.srt.layers.quantization.fp8_utils:cutlass_w8a8_block_fp8_linear_with_fallback",
              "CUTLASS FP8 block GEMM.",
              "srt/layers/quantization/fp8_utils.py:747"),
    _tripwire("triton_fp8_linear", "sglang.srt.layers.quantization.fp8_utils:triton_w8a8_block_fp8_linear",
              "Triton FP8 W8A8 block GEMM (float8e4nv).",
              "srt/layers/quantization/fp8_utils.py:972"),
    _tripwire("mxfp4_marlin_prepare",
              "sglang.srt.layers.quantization.mxfp4_marlin_moe:Mxfp4MarlinMoEMethod.process_weights_after_loading",
              "Under mxfp4_int8 no expert layer may take SGLang's MXFP4 Marlin path or its SM check.",
              "srt/layers/quantization/mxfp4_marlin_moe.py:103", "SGLANG_DSV4_MXFP4_MOE_BACKEND=mxfp4_int8"),
    Seam(
        name="tripwire.deep_gemm",
        target="sglang.srt.layers.deep_gemm_wrapper.configurer:ENABLE_JIT_DEEPGEMM",
        kind="value",
        replacement="dsv4_lab.tripwire:arm_deep_gemm",
        reason=("Every DeepGEMM kernel entry point (the deep_gemm package's own functions) raises, not only the "
                "FP8 linear: the mHC pre-norm GEMM is one no per-function wire covered. The flag is returned "
                "unchanged; arming happens as SGLang first decides on DeepGEMM."),
        upstream="srt/layers/deep_gemm_wrapper/configurer.py:35",
        when=(PATCH_ON, "DSV4_SM80_TRIPWIRE=1"),
        overlay="lab",
    ),
)

OBSERVERS = (
    _lab("poison_on_flush", "sglang.srt.managers.scheduler:Scheduler.flush_cache", "after",
         "dsv4_lab.hygiene:poison_after_flush",
         ("Page hygiene: after a flush, when every page is free, the pools are overwritten with 0xFF (NaN) so a "
          "later request that reads bytes it did not write shows it."),
         "srt/managers/scheduler.py:3846-3873", PATCH_ON, "DSV4_SM80_LAB_POISON=1"),
    _lab("memlog", "sglang.srt.model_executor.model_runner:ModelRunner.init_cuda_graphs", "after",
         "dsv4_lab.memlog:start_after_graphs",
         "The memory log over time (DSV4_SM80_LAB_MEMLOG) starts once a runner's CUDA graphs are captured.",
         "srt/model_executor/model_runner.py:838", PATCH_ON),
    _lab("route_trace_topk", "sglang.srt.layers.moe.topk:TopK.forward_cuda", "around", "dsv4_lab.routes:topk",
         "Vision routing evidence (DSV4_SM80_LAB_ROUTE_TRACE): image rows take bias_vl, text rows do not.",
         "srt/layers/moe/topk.py:484", "DSV4_SM80_VISION=1"),
    _lab("route_trace_hash", "sglang.srt.layers.moe.hash_topk:HashTopK.forward", "around",
         "dsv4_lab.routes:hash_topk",
         "The same for hash layers.",
         "srt/layers/moe/hash_topk.py:180", "DSV4_SM80_VISION=1"),
)

LAB_SEAMS: tuple[Seam, ...] = (*TRIPWIRE, *OBSERVERS)

# MUTANTS: dsv4_lab/mutants.py's MUTANT_SEAMS join the table here once that module exists.
try:
    from .mutants import MUTANT_SEAMS
except ModuleNotFoundError as e:
    if e.name != f"{__package__}.mutants":
        raise
else:
    LAB_SEAMS = (*LAB_SEAMS, *MUTANT_SEAMS)

__all__ = ["LAB_KNOBS", "LAB_SEAMS"]
