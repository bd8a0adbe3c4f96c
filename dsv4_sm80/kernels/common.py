"""Pieces shared by the Triton kernels of this package (not by their references, which stay independent)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def round_int8(v):
    """fp32 -> INT8, rounding half away from zero, saturating at +-127 (the symmetric INT8 grid)."""
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(-v + 0.5))
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)


def rope_table(freqs_cis: torch.Tensor) -> torch.Tensor:
    """SGLang's complex64 freqs_cis [max_pos, pairs] as the fp32 [max_pos, pairs, 2] (cos, sin) view the
    kernels read; a real table passes through."""
    return torch.view_as_real(freqs_cis) if freqs_cis.is_complex() else freqs_cis


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int | None:
    """Streaming multiprocessors of a CUDA device (a str or torch.device; an H200 132, an A800 108); None for
    any other device (the CPU interpreter), where each grid heuristic picks its own stand-in."""
    d = torch.device(device)
    return _multiprocessors(d.index or 0) if d.type == "cuda" else None
