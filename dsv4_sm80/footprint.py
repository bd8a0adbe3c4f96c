"""Memory arithmetic for a DSV4 checkpoint on the SM80 datapath, from its config.json alone.

Per GPU at a TP size: the resident bytes of the main model, the DSPARK draft and the vision tower in
each dense / MoE mode (after this overlay's load-time conversions), the KV bytes per token (BF16 main
rows, INT8 indexer) as SGLang 0.5.16's DSV4 pool configurator sizes them with this overlay's 1024-byte
row, and what is left for the KV pool on an 80 GB card: tokens and concurrent requests at a context.

    python -m dsv4_sm80 footprint [--model-path DIR | --config config.json] [--tp 4] [--dense bf16] ...

Sharding (SGLang 0.5.16): split across TP ranks are the embedding and LM head
(vocab-parallel), `wq_b` and `wo_a` (column), `wo_b` (row), the attention sink (per head), shared experts
and routed experts (the intermediate dimension); everything else is replicated (`wq_a`, `wkv`, the
compressors, the indexer, the router incl. `tid2eid`, norms, `hc_*`, DSPARK `main_proj` and heads, vision).

Bytes per weight after loading, by mode:
  FP8 block linears   bf16: 2 (the FP8 pair is freed)   fp8_marlin: 1 + a BF16 scale per 128 along K
                      (`wo_a` and `main_proj` are BF16 in both modes)
  MXFP4 experts       0.5 + 1/32 (4-bit codes + E8M0 per 32; both MoE backends keep them 4-bit)
  everything else     as stored (`tid2eid` as int32)
Not counted: activations, NCCL buffers, the CUDA graphs' private pool, allocator slack: those are the
reserves of `plan` (defaults: a measured steady state, docs/footprint.md). The W4A8 MoE's
expanded path (prefill forwards above 8192 tokens, i.e. `--chunked-prefill-size` raised above SGLang's 8192 for
80 GB cards) adds a transient workspace of up to 512 MiB to a MoE call's activations; the start-up line names it
and whether the server's chunked prefill size lets a forward reach it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .checkpoint import format as fmt

GIB = 2 ** 30
VISION_PREFIXES = ("vision.", "aligner.", "image_")  # checkpoint names (vision_backport.model splits by them)
DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8, "I32": 4}
SPLIT = re.compile(r"^(embed|head)\.weight$|\.attn\.(wq_b|wo_a|wo_b)\.(weight|scale)$|\.attn\.attn_sink$"
                   r"|\.ffn\.(shared_experts|experts\.\d+)\.w[123]\.(weight|scale)$")
ALWAYS_BF16 = re.compile(r"\.attn\.wo_a\.weight$|\.main_proj\.weight$")


def category(name: str) -> tuple[str, str]:
    """(part, category) of a checkpoint tensor: part is main / draft / vision."""
    if name.startswith(VISION_PREFIXES):  # ViT, aligner, image sentinel vectors
        return "vision", "vision"
    part = "draft" if name.startswith("mtp.") else "main"
    rules = (("experts", r"\.ffn\.experts\."), ("shared experts", r"\.shared_experts\."),
             ("indexer", r"\.attn\.indexer\."), ("compressor", r"\.attn\.compressor\."),
             ("attention", r"\.attn\.|\.attn_norm\."), ("router", r"\.ffn\.gate\."), ("mHC", r"(^|\.)hc_"),
             ("embedding", r"^embed\."), ("head", r"^head\."), ("DSPARK heads", r"main_proj|markov|confidence"))
    for cat, pat in rules:
        if re.search(pat, name):
            return part, cat
    return part, "norms"


def resident_bytes(spec, dense: str, tp: int) -> float:
    """Bytes one TP rank holds for one checkpoint tensor after this overlay's loading."""
    n = math.prod(spec.shape)
    name = spec.name
    if spec.dtype == "F8_E4M3":  # an FP8 block linear's weight
        if dense == "native":
            b = n
        elif dense == "bf16" or ALWAYS_BF16.search(name):
            b = 2 * n
        else:  # fp8_marlin: 1 byte per weight + a BF16 scale per (output row, 128 inputs)
            b = n + 2 * n / 128
    elif spec.dtype == "F8_E8M0" and name.endswith(".scale"):
        weight_is_fp8 = ".experts." not in name
        if weight_is_fp8:  # FP8 block scales: freed (bf16) or replaced by Marlin's (counted above)
            b = n if dense == "native" else 0
        else:
            b = n  # E8M0 per 32 experts' weights stay
    elif spec.dtype == "I8" and ".experts." in name:
        b = n  # two 4-bit codes per byte
    elif spec.dtype == "I64":
        b = 4 * n  # tid2eid as int32
    else:
        b = DTYPE_BYTES[spec.dtype] * n
    return b / tp if SPLIT.search(name) else b


def weights(config, tp: int = 4, dense: str = "bf16") -> dict:
    """{part: {category: bytes per GPU}} for main / draft / vision."""
    out: dict = {}
    for spec in fmt.inventory(config):
        part, cat = category(spec.name)
        out.setdefault(part, {}).setdefault(cat, 0.0)
        out[part][cat] += resident_bytes(spec, dense, tp)
    return out


@dataclass
class KVGeometry:
    layers: int
    c4_layers: int
    c128_layers: int
    kv_row: int = 1024  # BF16 [512]; SGLang's FP8 layout is 584
    indexer_row: int = 132  # INT8 [128] + fp32 scale
    swa_ratio: float = 0.1  # --swa-full-tokens-ratio
    c4_ring: int = 8  # 16 with speculative decoding
    swa_page: int = 128
    state_bytes: int = 4  # SGLANG_DSV4_COMPRESS_STATE_DTYPE=float32
    head_dim: int = 512
    indexer_dim: int = 128

    @classmethod
    def of(cls, config, **kw) -> KVGeometry:
        ratios = list(config["compress_ratios"])[: int(config["num_hidden_layers"])]
        return cls(layers=len(ratios), c4_layers=ratios.count(4), c128_layers=ratios.count(128), **kw)

    def intrinsic_per_token(self) -> float:
        """Compressed KV + indexer bytes per token of context (the SWA window is per request)."""
        return (self.c4_layers / 4 + self.c128_layers / 128) * self.kv_row + self.c4_layers / 4 * self.indexer_row

    def per_full_token(self) -> float:
        """SGLang 0.5.16's DSV4PoolConfigurator._get_bytes_per_full_token (pool_configurator.py:672) with this
        row size: the budget each pool token costs, SWA share and C4 state rings included."""
        c4_state = 2 * 2 * self.head_dim * self.state_bytes
        c4_indexer_state = 2 * 2 * self.indexer_dim * self.state_bytes
        ring = self.c4_ring / self.swa_page
        return (self.swa_ratio * self.kv_row * self.layers
                + self.kv_row * self.c4_layers / 4 + self.kv_row * self.c128_layers / 128
                + self.indexer_row * self.c4_layers / 4
                + self.swa_ratio * ring * (c4_state + c4_indexer_state) * self.c4_layers)

    def c128_state_per_request(self, speculative: bool) -> float:
        """Request-scoped C128 compressor ring (raw kv + score per slot), reserved per running-request slot."""
        ring = 256 if speculative else 128
        return self.c128_layers * ring * 2 * self.head_dim * self.state_bytes


@dataclass
class Plan:
    tp: int
    dense: str
    weights_gib: dict
    kv_per_full_token: float
    kv_intrinsic_per_token: float
    c128_state_gib: float
    reserves_gib: dict
    kv_budget_gib: float
    tokens: int
    context: int
    concurrency: float
    notes: list = field(default_factory=list)


def plan(config, tp: int = 4, dense: str = "bf16", gpu_gib: float = 80.0, draft: bool = True,
         speculative: bool = True, graphs_gib: float = 1.81, runtime_gib: float = 1.55,
         activations_gib: float = 4.0, max_running_requests: int = 256, context: int = 524288) -> Plan:
    w = weights(config, tp, dense)
    parts = {p: sum(c.values()) / GIB for p, c in w.items()}
    if not draft:
        parts.pop("draft", None)
    geo = KVGeometry.of(config, c4_ring=16 if speculative else 8)
    per_full = geo.per_full_token() * (geo.layers + 1) / geo.layers if draft else geo.per_full_token()
    c128 = geo.c128_state_per_request(speculative) * max_running_requests / GIB
    reserves = {"CUDA graphs": graphs_gib, "CUDA context / NCCL": runtime_gib, "activations": activations_gib,
                "C128 state rings": c128}
    budget = gpu_gib - sum(parts.values()) - sum(reserves.values())
    tokens = int(max(budget, 0) * GIB / per_full)
    return Plan(tp=tp, dense=dense, weights_gib=parts, kv_per_full_token=per_full,
                kv_intrinsic_per_token=geo.intrinsic_per_token(), c128_state_gib=c128, reserves_gib=reserves,
                kv_budget_gib=budget, tokens=tokens, context=context, concurrency=tokens / context,
                notes=["every TP rank stores the whole KV (one latent KV head): more cards add no context",
                       f"draft x{(geo.layers + 1) / geo.layers:.3f} on KV (one DSPARK layer's SWA pool)" if draft else
                       "no draft"])


def report(config, tp: int = 4, **kw) -> str:
    lines = []
    for dense in ("bf16", "fp8_marlin"):
        p = plan(config, tp=tp, dense=dense, **kw)
        w = weights(config, tp, dense)
        lines.append(f"dense={dense}, MoE 4-bit resident (mxfp4_int8 or marlin), TP{tp}, per GPU:")
        for part in ("main", "draft", "vision"):
            if part in p.weights_gib:
                cats = ", ".join(f"{c} {b / GIB:.2f}" for c, b in sorted(w[part].items(), key=lambda x: -x[1])
                                 if b / GIB >= 0.005)
                lines.append(f"  {part:6s} {p.weights_gib[part]:6.2f} GiB  ({cats})")
        lines.append("  reserves " + ", ".join(f"{k} {v:.2f}" for k, v in p.reserves_gib.items()) + " GiB")
        lines.append(f"  KV: {p.kv_intrinsic_per_token:,.0f} B per context token (compressed KV + INT8 indexer), "
                     f"{p.kv_per_full_token:,.1f} B per pool token as SGLang sizes it")
        lines.append(f"  KV budget {p.kv_budget_gib:.2f} GiB -> {p.tokens:,} tokens = {p.concurrency:.2f} requests "
                     f"of {p.context:,} tokens" + ("" if p.concurrency >= 1 else "  (DOES NOT FIT)"))
    return "\n".join(lines)
