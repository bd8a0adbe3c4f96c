"""Which W4A8 MoE kernel runs for how many (token, expert) pairs: the table `w4a8_moe` reads, as data.

Each row: the pair range it serves (its reason names the token counts at DSV4's top-6; the boundary at 4,096
pairs is 682 tokens), the kernel family and its tile, why, and the measured figure that chose it. Figures are H200
ones at DSV4-Flash TP4 per-rank shapes (256 experts, hidden 4096, intermediate 512, top-6), CUDA-graph replays over
20 routings, Marlin (SGLang's `fused_marlin_moe`) in the same run where named; the date is the run's (docs/moe.md
gives the commands). Retune on an A800 with `python bench/moe.py --variants` (every row's kernel at every size, Marlin
beside).

The first row whose range, intermediate bound and `expand_ok` condition hold is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from .w4a8_moe_expand import EXPAND_TOKENS, Expand
from .w4a8_moe_gemv import Gemv
from .w4a8_moe_mma import Mma
from .w4a8_moe_wide import Wide

TOP_K = 6  # DSV4's routed experts per token: the token counts named below
H200 = "H200, mma.sync only, bench/moe.py"


@dataclass(frozen=True)
class Row:
    name: str
    first_pair: int
    last_pair: int | None  # None: no upper bound
    kernel: Wide | Gemv | Mma | Expand
    reason: str
    figure: str
    max_inter: int | None = None  # the row serves intermediates (per rank) up to this width
    min_inter: int = 0  # ... and above this one
    needs_expand_ok: bool = False  # the caller's word that every column of both shift maps is shiftable

    def takes(self, pairs: int, inter: int, expand_ok: bool) -> bool:
        return (self.first_pair <= pairs and (self.last_pair is None or pairs <= self.last_pair)
                and (self.max_inter is None or inter <= self.max_inter) and inter > self.min_inter
                and (expand_ok or not self.needs_expand_ok))


PREFILL_TILE = Mma(block_m=64, block_n=128, block_n2=128, warps=4, stages=3, shift=True, pair_bf16=True)

TABLE = (
    Row("wide", 1, 6, Wide(n=32, warps=16, n2=16, warps2=8),
        "one token: every load of a program issued at once, the input's INT8 rounding inside the gate-up launch and "
        "the top-k sum inside the down launch (two launches in all)",
        f"16.7 us at 1 token, 1.92x its 8.7 us launch + bytes floor, Marlin 53.8 ({H200}, 2026-12-04); the pair-block "
        f"MMA tile it replaced 24.8, gemv 29.3 ({H200}, 2026-12-04 and 2026-12-02)"),
    Row("gemv", 7, 32 * TOP_K, Gemv(split_k=8, n=128, n2=128, group=32),
        "2-32 tokens: each pair's one row on CUDA cores (DP4A), no padding rows; K in 8 shares for enough programs",
        f"29.7 / 41.0 / 71.2 / 113.5 / 200.9 us at 2 / 4 / 8 / 16 / 32 tokens against the aligned 16x32 MMA tile's "
        f"49.9 / 66.8 / 96.8 / 150.4 / 231.4 ({H200}, 2026-12-02); 16 tokens at 90 % of copy bandwidth, Marlin 149.6 "
        f"against 111.9 ({H200}, 2026-12-04)", max_inter=512),
    Row("gemv, wide intermediate", 7, 16 * TOP_K, Gemv(split_k=8, n=128, n2=128, group=32),
        "2-16 tokens above 512 intermediate per rank (TP1 full width): the aligned MMA tile's extra column tiles pay "
        "from 16 tokens on",
        f"intermediate 2048: 125.4 against the pair-block MMA tile's 182.0 us at 4 tokens, 550.0 / 547.2 at 16, "
        f"1,119.1 against the aligned tile's 870.6 at 32 ({H200} --inter 2048, 2026-12-02)", min_inter=512),
    Row("mma 16x32", 7, 512 * TOP_K, Mma(block_m=16, block_n=32, block_n2=128, warps=2, stages=4),
        "33-512 tokens: ~1-12 rows an expert, so the 16-row tile pads least; 2 warps for 16-byte weight loads",
        f"48 / 64 tokens 282.8 / 323.7 us against gemv's 302.1 / 401.7 ({H200}, 2026-12-02); 64 tokens 317.2 against "
        f"Marlin's 314.3, 512 tokens 457.1 against 498.8 ({H200}, 2026-12-04)"),
    Row("mma 16x32, bf16 pairs", 512 * TOP_K + 1, 4096,
        Mma(block_m=16, block_n=32, block_n2=128, warps=2, stages=4, pair_bf16=True),
        "513-682 tokens: the same tile, per-pair outputs in BF16 (half the bytes of the [pairs, H] buffer)",
        f"600 tokens 498.3 us against Marlin's 560.8 and the 64x128 tile's 735 ({H200}, 2026-12-02); 640 tokens 528.7 "
        f"against the 32x64 tile's 545.8 ({H200}, 2026-12-03)"),
    Row("mma 32x64 shift", 4097, 1280 * TOP_K,
        Mma(block_m=32, block_n=64, block_n2=128, warps=2, stages=4, shift=True, pair_bf16=True),
        "683-1,280 tokens: ~16-30 rows an expert fill one 32-row tile; 64 columns double the programs along N; the "
        "shift loop (int32 accumulation, no per-group conversion) where the columns allow",
        f"768 / 1,024 / 1,280 tokens 552.0 / 604.3 / 728.7 us against the 64x128 tile's 643.2 / 749.3 / 755.0 and "
        f"Marlin's 641.3 / 688.4 / 823.5 ({H200}, 2026-12-03)"),
    Row("expand", EXPAND_TOKENS * TOP_K + 1, None, Expand(tile=PREFILL_TILE, block_k=128, workspace_mb=512),
        "above 8,192 tokens, every column shiftable: the experts decoded once per call into an INT8 workspace, then "
        "plain INT8 grouped GEMMs; the decode runs at HBM speed and is a fixed cost per call",
        f"16,384 tokens 4,121.2 us against Marlin's 6,949.7 (0.59x) ({H200}, 2026-12-04); 4,096 tokens 1,933.2 "
        f"against the 64x128 tile's 1,520.5 ({H200}, 2026-12-02); the decode alone 903.6 us ({H200}, 2026-12-03)",
        needs_expand_ok=True),
    Row("mma 64x128 shift", 1280 * TOP_K + 1, None, PREFILL_TILE,
        "above 1,280 tokens: the prefill tile, with the shift loop where the columns allow",
        f"2,048 / 8,192 tokens 800.3 / 2,628.4 us against Marlin's 1,087.2 / 3,703.3 ({H200}, 2026-12-04)"),
)


def select(pairs: int, inter: int, expand_ok: bool = False) -> Row:
    """The table's row for a call of `pairs` (token, expert) pairs at this intermediate width per rank."""
    for row in TABLE:
        if row.takes(max(pairs, 1), inter, expand_ok):
            return row
    raise AssertionError(f"w4a8_moe table: no row for {pairs} pairs, intermediate {inter}")  # the last rows are open
