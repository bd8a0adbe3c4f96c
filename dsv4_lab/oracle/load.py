"""Load an official-format DeepSeek-V4 checkpoint (FP8 e4m3 128x128 blocks with UE8M0 scales, MXFP4 routed
experts) into transformers' `DeepseekV4ForCausalLM` with exact dequantization, in fp32, TF32 off.

transformers' FP8 integration with `dequantize=True` decodes every FP8 block and every MXFP4 expert into
full-precision weights (bit-equal to the float64 decode of the formats' definitions); BF16 tensors widen to
fp32 exactly. The DSPARK draft stages (`mtp.*`) are ignored by the library on purpose; any other missing or
unexpected key stops the load.
"""

from __future__ import annotations

import os

import torch


class ReferenceLoadError(RuntimeError):
    pass


def exact_arithmetic() -> None:
    """fp32 matmuls as fp32 (no TF32 on NVIDIA GPUs): the reference computes what the model defines."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def load_reference(ckpt: str, device: str = "cpu", read_elsewhere=None):
    """transformers' model of `ckpt` in fp32 on `device`, eval mode, weights exactly dequantized.
    read_elsewhere(key) -> True for checkpoint keys the caller loads itself (the library would call them
    unexpected): `dsv4_lab.vision.load` passes the Vision-Exp ones."""
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise ReferenceLoadError(f"oracle load: no config.json in {ckpt!r}; expected an official-format "
                                 "DeepSeek-V4 checkpoint directory (make one with `python -m dsv4_sm80 make-tiny`)")
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    exact_arithmetic()
    quant = FineGrainedFP8Config(dequantize=True, weight_block_size=(128, 128))
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        ckpt, quantization_config=quant, dtype=torch.float32, output_loading_info=True)
    bad = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    bad["unexpected_keys"] = [k for k in bad["unexpected_keys"]
                              if not k.startswith("mtp.") and not (read_elsewhere and read_elsewhere(k))]
    if any(bad.values()):
        raise ReferenceLoadError(
            f"oracle load: transformers loaded {ckpt!r} with {', '.join(f'{k} {v[:5]}' for k, v in bad.items() if v)}; "
            "expected every tensor matched (only mtp.* ignored). The checkpoint is not in the official format "
            "transformers' DeepSeek-V4 reads: check it with `python compat_check.py --model-path DIR`")
    # norms, embeddings and the head load in their stored BF16; fp32 holds every BF16 value exactly
    model = model.float().to(device).eval()
    model.config.use_cache = False
    return model
