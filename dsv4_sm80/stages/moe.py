"""Routed experts on SM80: the MXFP4 experts stay 4-bit resident (codes + one E8M0 byte per 32).

`SGLANG_DSV4_MXFP4_MOE_BACKEND` picks how they multiply:
- `mxfp4_int8` (default): `Sm80W4A8MoEMethod`, the Triton W4A8 kernels of `kernels/w4a8_moe.py` on INT8
  tensor cores (codes decoded to INT8 in the kernel, activations quantized per token, exact per-32
  weight scales). Not an `Mxfp4MarlinMoEMethod`, so DeepseekV2MoE does not scale its output
  (`maybe_fuse_routed_scale_and_shared_add` in SGLang's deepseek_v2.py): the method applies the routed scaling
  factor itself, exactly once. What it keeps per layer beside SGLang's parameters is one `W4A8Layer` at
  `layer.dsv4_w4a8` (`w4a8_layer(layer)` reads it); the start-up footprint line reads it from there.
- `marlin`: SGLang 0.5.16's own `Mxfp4MarlinMoEMethod` (W4A16, BF16 MMA, lossless), with its one SM80
  refusal (`mxfp4_marlin_moe.py:118`) lifted.

Routing is the model's own (SGLang's TopK for DSV4: hash layers by `tid2eid`, `sqrtsoftplus` scores with
the correction bias, `norm_topk_prob`); both methods consume its STANDARD top-k output. Both need
SGLang's MoE runner backend to be `marlin` (that is what builds the MXFP4 parameter layout) and tensor
parallelism only (the expert-parallel kernels need SM90): this stage's rules in `seams.SERVER_ARGS`, judged by
the gate and set by the launch stage.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import torch

from .. import env

# --- the marlin backend: SGLang's own method, SM80 refusal lifted ---------------------------------

def marlin_on_sm80(is_sm90_supported):
    """Value of mxfp4_marlin_moe.is_sm90_supported (that module's global only): true on SM80+ too.
    The MXFP4 Marlin MoE kernels are SM80-legal PTX (mma.sync bf16, ldmatrix, cp.async); the check at
    mxfp4_marlin_moe.py:118 is the only thing that refuses them."""
    if getattr(is_sm90_supported, "_dsv4_sm80", False):
        return is_sm90_supported

    @functools.wraps(is_sm90_supported)
    def sm80_or_newer(*args, **kwargs):
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8

    sm80_or_newer._dsv4_sm80 = True
    return sm80_or_newer


# --- the mxfp4_int8 backend --------------------------------------------------------------------

W4A8_ATTR = "dsv4_w4a8"  # the FusedMoE layer attribute holding its W4A8Layer


@dataclasses.dataclass
class W4A8Layer:
    """The mxfp4_int8 method's state of one FusedMoE layer, set once after loading (the parameters themselves
    stay SGLang's, repacked in place)."""
    w13_eref: torch.Tensor  # shift maps (`shift_refs`): 1 byte per expert and output row, which columns
    w2_eref: torch.Tensor  # accumulate in int32
    expand_ok: bool  # every column of both maps shiftable: large prefill batches may take the expanded kernel
    repack_seconds: float  # the load-time repack and maps, for the start-up line


def w4a8_layer(module) -> W4A8Layer | None:
    """The module's W4A8Layer, or None for a module the mxfp4_int8 method did not load."""
    return getattr(module, W4A8_ATTR, None)


@functools.cache
def _method_class():
    from sglang.srt.layers.quantization.mxfp4_marlin_moe import Mxfp4MarlinMoEMethod

    from ..kernels import w4a8_moe

    class Sm80W4A8MoEMethod:
        """MXFP4 experts, W4A8 on INT8 tensor cores. Parameters are created exactly as SGLang's
        MXFP4 Marlin method creates them (same names, shapes, loaders: the checkpoint's bytes), then
        repacked in place on the GPU for the kernel (4 bits per weight stay 4 bits)."""

        def __init__(self, fp8_method, prefix: str = ""):
            self._fp8 = fp8_method
            self._layout = Mxfp4MarlinMoEMethod(fp8_method, prefix=prefix)
            self.prefix = prefix
            self.moe_runner_config = None

        def create_weights(self, layer, *args, **kwargs):
            self._layout.create_weights(layer, *args, **kwargs)
            self.hidden_pad = self._layout.hidden_pad

        def create_moe_runner(self, layer, moe_runner_config):
            self.moe_runner_config = moe_runner_config

        def process_weights_after_loading(self, layer) -> None:
            # Fp8MoEMethod's processing would only view these bytes as int8 under the marlin runner
            # backend (fp8.py:1545-1549); they already are, so it is not called.
            t0 = time.perf_counter()
            w4a8_moe.repack_mxfp4_for_w4a8(layer.w13_weight.data)
            w4a8_moe.repack_mxfp4_for_w4a8(layer.w2_weight.data)
            w13_eref = w4a8_moe.shift_refs(layer.w13_weight_scale_inv.data)
            w2_eref = w4a8_moe.shift_refs(layer.w2_weight_scale_inv.data)
            expand_ok = bool((w13_eref > 0).all()) and bool((w2_eref > 0).all())
            setattr(layer, W4A8_ATTR, W4A8Layer(w13_eref, w2_eref, expand_ok, time.perf_counter() - t0))

        def apply(self, layer, dispatch_output):
            from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
            from sglang.srt.layers.moe.topk import TopKOutputChecker

            topk_output = dispatch_output.topk_output
            if not TopKOutputChecker.format_is_standard(topk_output):
                raise ValueError(f"dsv4-sm80 moe: unsupported top-k output format {topk_output.format}")
            x = dispatch_output.hidden_states
            if self.hidden_pad:
                x = torch.nn.functional.pad(x, (0, self.hidden_pad))
            cfg = self.moe_runner_config
            state = w4a8_layer(layer)
            out = w4a8_moe.w4a8_moe(
                x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv,
                topk_output.topk_weights, topk_output.topk_ids,
                swiglu_limit=float(cfg.swiglu_limit or 0.0),
                routed_scaling_factor=float(cfg.routed_scaling_factor or 1.0),
                w13_eref=state.w13_eref, w2_eref=state.w2_eref, expand_ok=state.expand_ok,
            )
            if self.hidden_pad:
                out = out[:, : x.shape[1] - self.hidden_pad]
            return StandardCombineInput(hidden_states=out)

    return Sm80W4A8MoEMethod


def select_moe_method(original, self, layer, prefix):
    """Around Fp8Config.get_quant_method (fp8.py:336-399): SGLang returns its MXFP4 Marlin method for
    FP4 experts under the marlin runner backend; mxfp4_int8 swaps in the W4A8 method."""
    from sglang.srt.layers.quantization.mxfp4_marlin_moe import Mxfp4MarlinMoEMethod

    method = original(self, layer, prefix)
    if type(method) is Mxfp4MarlinMoEMethod and env.get(env.MOE_BACKEND) == "mxfp4_int8":
        return _method_class()(method._fp8, prefix)
    return method


# --- the start-up memory line --------------------------------------------------------------------

def expert_footprint(model) -> dict:
    """Over the model's mxfp4_int8 expert layers (those holding a W4A8Layer): bytes resident and what 4 bits + one
    E8M0 byte per 32 weights is, plus the shift maps (one byte per expert and output row; `eref_bytes`, included in
    `bytes`), the fraction of their columns that are shiftable, and the seconds the repack took."""
    layers, resident, weights, seconds = 0, 0, 0, 0.0
    eref_bytes, eref_cols, shiftable = 0, 0, 0
    for _, mod in model.named_modules():
        state = w4a8_layer(mod)
        if state is None:
            continue
        layers += 1
        seconds += state.repack_seconds
        resident += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
        for t in (state.w13_eref, state.w2_eref):
            eref_bytes += t.numel() * t.element_size()
            eref_cols += t.numel()
            shiftable += int((t > 0).sum())
        e, two_i = mod.w13_weight.shape[0], 2 * mod.intermediate_size_per_partition
        hidden = mod.hidden_size
        weights += e * (two_i * hidden + hidden * two_i // 2)
    return {"layers": layers, "bytes": resident + eref_bytes, "weights": weights,
            "expected": weights // 2 + weights // 32 + eref_bytes, "eref_bytes": eref_bytes,
            "shiftable": shiftable / eref_cols if eref_cols else None,
            "backends": ["mxfp4_int8"] if layers else [], "repack_seconds": seconds}


def log_expert_footprint(result, model, *args, **kwargs):
    """After DefaultModelLoader.load_weights_and_postprocess (loader.py:804): one line per GPU."""
    f = expert_footprint(model)
    if not f["layers"]:
        return result
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    bits = 8 * f["bytes"] / f["weights"]
    line = (f"[rank {rank}] dsv4-sm80 moe ({'/'.join(f['backends'])}): {f['layers']} expert layers, "
            f"{f['bytes'] / 2**30:.3f} GiB resident = {bits:.3f} bits/weight "
            f"(4-bit codes + E8M0 per 32 = 4.250"
            + (f", + shift maps {8 * f['eref_bytes'] / f['weights']:.4f}; {100 * f['shiftable']:.1f} % of columns "
               f"shiftable" if f["eref_bytes"] else "") + f"); repack {f['repack_seconds']:.2f} s")
    if f["bytes"] != f["expected"]:
        line += f"; MISMATCH: expected {f['expected']} bytes"
    print(line, file=sys.stderr, flush=True)
    return result
