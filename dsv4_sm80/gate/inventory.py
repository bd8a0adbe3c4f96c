"""The checkpoint's tensors against the native inventory its config implies (`checkpoint.format`):
keys, dense FP8 pairs, MXFP4 experts, vision tensors, the rest; a converted checkpoint is named as such."""

from __future__ import annotations

from ..checkpoint import format as fmt
from .report import OFFICIAL, Finding, fail, ok, skip


def compare_inventory(specs, actual: dict, vision: bool) -> list[Finding]:
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
            return fail(check, f"{len(bad)} {noun} tensors {wrong_phrase} (e.g. {s.name} {g[0]} {list(g[1])}, "
                                f"expected {s.dtype} {list(s.shape)})", want, fix)
        if miss:
            return fail(check, f"{len(miss)} {noun} tensors missing (e.g. {miss[0].name})", want, fix)
        return ok(check, ok_text)

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
        out.append(fail("model.keys", "; ".join(bits) + (" - HF-style names: a converted checkpoint" if hf else ""),
                         f"the {len(specs)} native keys the config implies (embed.weight, "
                         "layers.N.attn.wq_a.weight, ...)",
                         f"use {OFFICIAL}; never a converted one"))
    else:
        out.append(ok("model.keys", f"{len(specs)} native keys"))

    # dense FP8 block linears; the community converter's signature is named as such
    dense_want = "F8_E4M3 weight + F8_E8M0 scale [ceil(out/128), ceil(in/128)] for every dense linear"
    dense_fix = f"use {OFFICIAL}: dsv4-sm80 dequantizes to BF16 at load, it never needs converted weights"
    converted = [(s, g) for s, g in wrong if s.family == fmt.FP8_WEIGHT and g[0] in ("BF16", "F16", "F32")
                 and s.name[:-len(".weight")] + ".scale" not in actual]
    if converted:
        s, g = converted[0]
        out.append(fail("model.dense_fp8", f"{len(converted)} FP8 linears stored as {g[0]} without their .scale "
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
        out.append(fail("model.vision", f"{len(vision_extra)} vision tensors (e.g. {vision_extra[0]}) but no "
                         "vision_* fields in config.json",
                         "vision_* config fields with vision tensors (Vision-Exp) or neither (Flash)",
                         f"the config was altered; use {OFFICIAL}"))
    else:
        out.append(skip("model.vision", "text-only checkpoint"))

    # remaining tensors (BF16 / F32 / I64 as shipped); missing ones are model.keys' finding
    p_wrong = [(s, g) for s, g in wrong if s.family == fmt.PLAIN]
    if p_wrong:
        s, g = p_wrong[0]
        out.append(fail("model.tensors", f"{len(p_wrong)} tensors with another dtype/shape "
                         f"(e.g. {s.name} {g[0]} {list(g[1])})",
                         f"as shipped (e.g. {s.name} {s.dtype} {list(s.shape)})", f"use {OFFICIAL}"))
    else:
        out.append(ok("model.tensors", "BF16 / F32 / I64 tensors as shipped"))
    return out
