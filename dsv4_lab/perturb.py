"""Lab: native SGLang's sensitivity to a rounding-level change of its input, as a second noise floor.

Why: the SM80 path and native differ in rounding at every linear (BF16 against native's FP8 activations), and native's
FP8 activation rounding turns any tiny input difference into ~1e-2 output differences wherever a value crosses a
rounding boundary (a module trace of 2026-12-01, `steps.sh trace` at 83c84a6: a 2.9e-5 input difference at layer 0's
first linear, 2.6e-2 at its output). The batch floor (native against itself across batch compositions and machines)
hardly exercises that: native's kernels are nearly batch-invariant, so two native runs see almost identical inputs. This
floor asks instead: how far do native's logprobs move when its embedding output changes by one BF16 unit in the last
place in a small fraction of entries, i.e. by as much as a different rounding order upstream would change it? It is
stated beside the batch floor, never in place of it.

How: `perturb_spec(fraction)` is a `forward_hooks` server argument (SGLang 0.5.16's hook manager registers it on
`model.embed_tokens` after CUDA-graph capture: eager forwards only); its hook returns the embedding output with
each entry moved one unit in the last place, up or down at random, with probability `fraction` (zeros and
non-finite values untouched). Seeded per call (seed + call count): a run is repeatable, calls differ.

    engine = sglang.Engine(..., forward_hooks=perturb_spec(1e-4), disable_cuda_graph=True)

Lab only: never a default, never for serving.
"""

from __future__ import annotations

import sys

FACTORY = "dsv4_lab.perturb:factory"
TARGET = "model.embed_tokens"


def perturb_spec(fraction: float, seed: int = 0, target: str = TARGET) -> list:
    """The `forward_hooks` server argument: `target`'s output moved one ulp in `fraction` of its entries."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction={fraction}: must be in (0, 1] (the share of entries moved by one ulp)")
    return [{"name": "dsv4-sm80-perturb", "target_modules": [target], "hook_factory": FACTORY,
             "config": {"fraction": float(fraction), "seed": int(seed)}}]


def ulp_flip(x, fraction: float, generator):
    """x (bf16, fp16 or fp32) with each nonzero finite entry moved one unit in the last place, up or down in
    magnitude at random, with probability `fraction`; the others unchanged. A new tensor."""
    import torch

    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    if x.dtype not in ints:
        raise TypeError(f"ulp_flip: {x.dtype} is not bf16, fp16 or fp32")
    pick = torch.rand(x.shape, generator=generator, device=x.device) < fraction
    up = torch.rand(x.shape, generator=generator, device=x.device) < 0.5
    ok = pick & torch.isfinite(x) & (x != 0)
    # sign-magnitude: +1 on the bit pattern is one ulp further from zero, -1 one ulp closer (never across zero
    # from a nonzero value: the smallest subnormal goes to zero, which is still one ulp)
    step = torch.where(up, 1, -1).to(ints[x.dtype]) * ok.to(ints[x.dtype])
    out = (x.contiguous().view(ints[x.dtype]) + step).view(x.dtype)
    return torch.where(torch.isfinite(out), out, x)  # the largest finite value moved up would be inf: kept


def factory(config: dict):
    """SGLang's hook factory contract (hook_manager.py:31): config -> hook(module, inputs, output); the hook's
    return value replaces the module's output (torch forward-hook semantics)."""
    import torch

    fraction, seed = float(config["fraction"]), int(config.get("seed", 0))
    state = {"calls": 0, "said": False}

    def hook(module, inputs, output):
        if not torch.is_tensor(output) or not output.is_floating_point():
            return None
        g = torch.Generator(device=output.device)
        g.manual_seed(seed + state["calls"])
        state["calls"] += 1
        if not state["said"]:
            state["said"] = True
            print(f"lab_perturb: {type(module).__name__} output moved one ulp in {fraction:g} of its entries "
                  f"(seed {seed}; noise-floor experiment, not a serving configuration)", file=sys.stderr, flush=True)
        return ulp_flip(output, fraction, g)

    return hook
