"""Tripwire for lab runs (`DSV4_SM80_TRIPWIRE=1`): every SM90/SM100-only entry point the SM80 datapath must
never reach is replaced by a function that raises, naming it. A lab run on an H200 with the tripwire on
then proves the path it measured is the one an A800 can run: if anything still reached FlashMLA's FP8
workspace, DeepGEMM, the cluster top-k, a Triton float8e4nv kernel or the MXFP4 Marlin SM check (under
mxfp4_int8), the run fails here instead of quietly using SM90 hardware.

Each tripped entry point has its own function (the seam table gives each replacement one seam), except
DeepGEMM: after a DeepGEMM call was found that no per-function wire covered (`tf32_hc_prenorm_gemm`, in
every layer's mHC; now seam `mhc.hc_prenorm_gemm`), `arm_deep_gemm` replaces every kernel entry point of
the `deep_gemm` package at once, so an unlisted one cannot slip through a lab run again.
"""

from __future__ import annotations

import inspect
import os
import sys


class TripwireError(RuntimeError):
    """An SM90/SM100-only entry point was reached with the SM80 datapath on."""


def _wire(what: str, why: str):
    def tripped(*args, **kwargs):
        raise TripwireError(f"dsv4-sm80 tripwire: {what} was reached ({why}); the SM80 datapath must not call it")

    tripped.__name__ = tripped.__qualname__ = "tripwire_" + what.replace(" ", "_").replace(".", "_")
    return tripped


fp8_k_pack = _wire("quant_to_nope_fp8_rope_bf16_pack_triton", "Triton float8e4nv, sm_89+")
fp8_k_dequant = _wire("dequantize_k_cache_paged", "Triton float8e4nv workspace for FlashMLA sparse prefill")
topk_v2 = _wire("topk_transform_512_v2", "thread-block clusters, sm_90+")
deepgemm_linear = _wire("deepgemm_w8a8_block_fp8_linear_with_fallback", "DeepGEMM FP8 GEMM, sm_90+")
cutlass_linear = _wire("cutlass_w8a8_block_fp8_linear_with_fallback", "CUTLASS FP8 block GEMM, sm_89+")
triton_fp8_linear = _wire("triton_w8a8_block_fp8_linear", "Triton FP8 W8A8 GEMM, sm_89+")
mxfp4_marlin_prepare = _wire("Mxfp4MarlinMoEMethod.process_weights_after_loading",
                             "the MXFP4 Marlin path and its SM check, with SGLANG_DSV4_MXFP4_MOE_BACKEND=mxfp4_int8")


# The modules whose functions launch DeepGEMM kernels (built for SM90/SM100 only). Its `utils.*` helpers
# (torch-level casts, layout arithmetic) and its tvm-ffi settings (get/set_num_sms, get/set_pdl, ...) stay.
DEEP_GEMM_KERNEL_MODULES = ("deep_gemm", "deep_gemm.mega")


def arm_deep_gemm(enable_jit_deepgemm):
    """Value seam on SGLang's `ENABLE_JIT_DEEPGEMM` (computed once, early, by every DeepGEMM user's import):
    returns it unchanged and, as a side effect, replaces in the `deep_gemm` package itself every public
    function defined by DEEP_GEMM_KERNEL_MODULES with one that raises. SGLang's DSV4 path reaches DeepGEMM as
    `deep_gemm.X` or `from deep_gemm import X` at call time, so both see the wire. Idempotent."""
    try:
        import deep_gemm
    except ImportError:
        return enable_jit_deepgemm
    armed = []
    for name in sorted(dir(deep_gemm)):
        obj = getattr(deep_gemm, name)
        if (name.startswith("_") or not inspect.isfunction(obj) or getattr(obj, "dsv4_tripwire", False)
                or obj.__module__ not in DEEP_GEMM_KERNEL_MODULES):
            continue
        wire = _wire(f"deep_gemm.{name}", "DeepGEMM, built for SM90/SM100 only")
        wire.dsv4_tripwire = True
        setattr(deep_gemm, name, wire)
        armed.append(name)
    if armed:  # a lab log then shows the wire was in place (a run that never trips says nothing by itself)
        print(f"dsv4-sm80 tripwire: {len(armed)} DeepGEMM entry points armed (pid {os.getpid()}), "
              f"tf32_hc_prenorm_gemm among them: {'tf32_hc_prenorm_gemm' in armed}", file=sys.stderr, flush=True)
    return enable_jit_deepgemm


def _deep_gemm_armed() -> bool:
    dg = sys.modules.get("deep_gemm")
    return bool(dg is not None and getattr(getattr(dg, "tf32_hc_prenorm_gemm", None), "dsv4_tripwire", False))


arm_deep_gemm.applied = _deep_gemm_armed  # the seam's mark (its value is returned unchanged)
