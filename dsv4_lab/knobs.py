"""The lab's environment knobs. Read only in lab runs (DSV4_SM80_LAB=1); the product's contract is
`dsv4_sm80/env.py`, which also holds the gate's two lab overrides (DSV4_SM80_LAB_GPU_COUNT, DSV4_SM80_LAB_CC)
because the product gate reads them and prints the lab banner."""

from __future__ import annotations

from dsv4_sm80.env import Knob

TRIPWIRE = Knob(
    "DSV4_SM80_TRIPWIRE", "0", ("0", "1"),
    "Lab: every SM90/SM100-only entry point the SM80 datapath must not reach raises instead (dsv4_lab/tripwire.py).",
)

LAB_POISON = Knob(
    "DSV4_SM80_LAB_POISON", "0", ("0", "1"),
    "Lab (page hygiene): 1 overwrites every byte of the KV pools (KV rows, INT8 indexer pages, compressor "
    "state; target and draft) with 0xFF after each successful cache flush, so a request that reads bytes it "
    "did not write sees NaN (dsv4_lab/hygiene.py). Never for serving.",
)

LAB_ROUTE_TRACE = Knob(
    "DSV4_SM80_LAB_ROUTE_TRACE", "", (),
    "Lab (vision): append one JSON line per MoE top-k call that routes image rows to this file: rows, image "
    "rows, image rows whose experts are top-k of scores + bias_vl, image rows where that differs from the text "
    "rule, text rows changed (dsv4_lab/routes.py). Costs a second top-k and a device sync per layer; never for "
    "serving.",
)

LAB_MEMLOG = Knob(
    "DSV4_SM80_LAB_MEMLOG", "", (),
    "Lab (soak): append one JSON line every 10 s per model runner to this file, from the end of start-up: GPU "
    "bytes in use, PyTorch's allocator reserved and allocated, segments, retries (dsv4_lab/memlog.py), to "
    "tell allocator growth from growth outside it. Never for serving.",
)

LAB_MEMSITES = Knob(
    "DSV4_SM80_LAB_MEMSITES", "0", ("0", "1"),
    "Lab (soak), with DSV4_SM80_LAB_MEMLOG: record the Python stack of every GPU block allocated after start-up "
    "(PyTorch's memory history, live blocks only) and answer the soak's requests with the live bytes per "
    "allocating site, so memory that grows under load names the code holding it (dsv4_lab/memlog.py). "
    "Slows every allocation; never for serving.",
)

LAB_KNOBS = (TRIPWIRE, LAB_POISON, LAB_ROUTE_TRACE, LAB_MEMLOG, LAB_MEMSITES)

# MUTANTS: the mutation knob joins here once dsv4_lab/mutants.py exists (it exports MUTANT_KNOB).
try:
    from .mutants import MUTANT_KNOB
except ModuleNotFoundError as e:
    if e.name != f"{__package__}.mutants":
        raise
else:
    LAB_KNOBS = (*LAB_KNOBS, MUTANT_KNOB)


def get(knob: Knob, environ=None) -> str:
    from dsv4_sm80 import env

    return env.get(knob, environ)
