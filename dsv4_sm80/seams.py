"""The seam table: every SGLang 0.5.16 internal that dsv4-sm80 replaces, declared once.

A seam names its target (`module:attr.path`), the replacement (`module:callable`, imported only
when the target module is imported), how it is applied (`kind`), why, the upstream file:line it
replaces, and its toggle. `dsv4_sm80.apply` is the only code that applies them: it checks the
target file is the 0.5.16 file (`upstream.FINGERPRINTS`), that the target exists, applies the
seam exactly once and records the result for `doctor`.

Kinds:
  before   hook(*args, **kwargs) runs first; it may return (args, kwargs) to replace them
  after    hook(result, *args, **kwargs) runs last; it may return a new result
  around   hook(original, *args, **kwargs) returns the result
  replace  the attribute becomes `replacement` (a function or class; `__wrapped__` = original)
  value    the attribute becomes `replacement(original)` (module constants captured at import time);
           the replacement must be idempotent (applied exactly once is checked by equality)

Toggles: an "sm80" seam needs ENABLE_SGLANG_DSV4_A100_PATCH=1, a "vision" seam DSV4_SM80_VISION=1, a "lab" seam
DSV4_SM80_LAB=1; `when` adds conditions on other knobs of `dsv4_sm80.env` (or, for a lab seam, of the lab's knob
list) as "KNOB=value" or "KNOB=value|other" (either), e.g. a MoE seam used only by one backend.

One block per stage, in STAGES order: each seam is named `stage.what` and its replacement lives in
`dsv4_sm80/stages/<stage>.py`. Seams on one target apply in table order, each wrapping the one before; the vision
overlay's table (`vision_backport/seams.py`) and then the lab's (`dsv4_lab/seams.py`) come after this one.

Where a stage needs one of SGLang's server arguments set or refused, it declares a `ServerArg` in SERVER_ARGS: the
gate judges every one (a finding named like the rule, in every report) and the launch stage sets them, in one place,
before any scheduler process starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from . import env

KINDS = ("before", "after", "around", "replace", "value")
OVERLAYS = ("sm80", "vision", "lab")
STAGES = ("launch", "dense", "moe", "attention", "mhc", "requests")  # the product table's blocks, in order


@dataclass(frozen=True)
class Seam:
    name: str
    target: str
    kind: str
    replacement: str
    reason: str
    upstream: str  # "srt/...py:LINE[-LINE]", relative to the sglang package
    when: tuple[str, ...] = field(default=())
    # "sm80": part of the SM80 patch, only with ENABLE_SGLANG_DSV4_A100_PATCH=1. "vision": the Vision-Exp
    # overlay's (vision_backport/seams.py), only with DSV4_SM80_VISION=1, with the patch on or off, so the VL model
    # can also run on native SGLang for A/B. "lab": the laboratory's (dsv4_lab/seams.py), only with DSV4_SM80_LAB=1.
    overlay: str = "sm80"

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> tuple[str, ...]:
        return tuple(self.target.split(":", 1)[1].split("."))

    @property
    def upstream_file(self) -> str:
        return self.upstream.split(":", 1)[0]

    def enabled(self, environ: Mapping[str, str] | None = None) -> bool:
        if self.overlay == "sm80" and not env.patch_enabled(environ):
            return False
        if self.overlay == "vision" and env.get(env.VISION, environ) != "1":
            return False
        if self.overlay == "lab" and not env.lab_enabled(environ):
            return False
        knobs = {k.name: k for k in (*env.KNOBS, *env.lab_knobs())}
        for cond in self.when:
            name, values = cond.split("=", 1)
            if env.get(knobs[name], environ) not in values.split("|"):  # KNOB=a|b: either value
                return False
        return True


SEAMS: tuple[Seam, ...] = (
    # --- launch (launch.py): the gate inside SGLang's launch, the server arguments, a cold start's JIT builds ---
    Seam(
        name="launch.gate",
        target="sglang.srt.entrypoints.engine:Engine._launch_subprocesses",
        kind="before",
        replacement="dsv4_sm80.stages.launch:gate_and_set_args",
        reason=(
            "Users who inject the overlay with PYTHONPATH and run `python -m sglang.launch_server` (or "
            "sglang.Engine) bypass `serve` and the entrypoint; the gate must still refuse before any scheduler "
            "process starts, and the server arguments the stages need (SERVER_ARGS; the custom all-reduce off "
            "without NVLink) must be set before the schedulers receive them. Every launch path (Engine, HTTP "
            "server) goes through this classmethod."
        ),
        upstream="srt/entrypoints/engine.py:765-790",
    ),
    Seam(
        name="launch.jit_disk_full",
        target="sglang.jit_kernel.utils.compile:load_jit",
        kind="around",
        replacement="dsv4_sm80.stages.launch:load_jit_naming_a_full_disk",
        reason=("A JIT build that fails on a full disk (cold starts compile SGLang's JIT modules into "
                "TVM_FFI_CACHE_DIR) is reported as jit.disk_full naming the module, directory and free "
                "space, instead of a compiler or ninja error."),
        upstream="jit_kernel/utils/compile.py:170-295",
    ),
    Seam(
        name="launch.footprint",
        target="sglang.srt.model_executor.model_runner:ModelRunner.init_cuda_graphs",
        kind="after",
        replacement="dsv4_sm80.stages.launch:log_footprint",
        reason=(
            "One line per GPU and model once everything is allocated: weights (vision apart), the KV pool, "
            "the CUDA graphs' memory, the W4A8 MoE's expand workspace (a transient) and the free headroom, to "
            "compare with docs/footprint.md."
        ),
        upstream="srt/model_executor/model_runner.py:838",
    ),
    # --- dense (dense.py): FP8 block linears -> BF16 at load, or SGLang's FP8-Marlin W8A16 -----------------
    Seam(
        name="dense.quant_method",
        target="sglang.srt.layers.quantization.fp8:Fp8Config.get_quant_method",
        kind="around",
        replacement="dsv4_sm80.stages.dense:select_quant_method",
        reason=(
            "SM80 has no FP8 tensor cores: every FP8 block linear DSV4 builds gets the SM80 method "
            "(exact BF16 at load, BF16 GEMM) or, with SGLANG_DSV4_A100_DENSE=fp8_marlin, SGLang's own "
            "FP8-Marlin W8A16 forced on as an A800 selects it, also when a lab run is on SM90."
        ),
        upstream="srt/layers/quantization/fp8.py:336-354",
    ),
    Seam(
        name="dense.weight_loader_v2",
        target="sglang.srt.layers.linear:WEIGHT_LOADER_V2_SUPPORTED",
        kind="value",
        replacement="dsv4_sm80.stages.dense:with_sm80_loader_name",
        reason=(
            "Linear layers pick their weight loader by the quant method's class name (linear.py:367, "
            ":1449); the SM80 method loads the checkpoint's FP8 weight and block scale exactly as "
            "Fp8LinearMethod does, so it needs the block-scale-aware v2 loader - with v1 the fused "
            "wqkv_a and shared-expert gate_up narrow their 128-row block scales by weight rows."
        ),
        upstream="srt/layers/linear.py:58-79",
    ),
    Seam(
        name="dense.marlin_fp32_reduce",
        target="sglang.srt.layers.quantization.marlin_utils_fp8:should_use_atomic_add_reduce",
        kind="value",
        replacement="dsv4_sm80.stages.dense:marlin_reduce_as_sm80",
        reason=(
            "FP8-Marlin sums split-K partials with BF16 atomicAdd on SM90+ only (marlin_utils.py:479); "
            "a lab run on an H200 must reduce in fp32 as an A800 does, or it tests another datapath."
        ),
        upstream="srt/layers/quantization/marlin_utils_fp8.py:13",
    ),
    Seam(
        name="dense.wo_a_fp8_param",
        target="sglang.srt.models.deepseek_v4:MqaAttentionBase.__init__",
        kind="around",
        replacement="dsv4_sm80.stages.dense:build_wo_a_from_checkpoint",
        reason=(
            "wo_a is dequantized on the CPU, whole and unsharded, in every rank when the FP8 wo_a GEMM "
            "(DeepGEMM, SM90+) is off; building it with the FP8 quant config lets each rank load its "
            "FP8 shard and convert it on the GPU while the forward keeps its BF16 einsum."
        ),
        upstream="srt/models/deepseek_v4.py:378-511",
    ),
    Seam(
        name="dense.wo_a_no_cpu_dequant",
        target="sglang.srt.models.deepseek_v4:_dequant_fp8_wo_a",
        kind="replace",
        replacement="dsv4_sm80.stages.dense:keep_wo_a_fp8_for_gpu",
        reason=(
            "With wo_a built as an FP8 parameter pair (dense.wo_a_fp8_param) its weight and scale must "
            "reach the loader unchanged; the DSPARK draft binds this same function by name."
        ),
        upstream="srt/models/deepseek_v4.py:3112-3128",
    ),
    Seam(
        name="dense.load_summary",
        target="sglang.srt.model_loader.loader:DefaultModelLoader.load_weights_and_postprocess",
        kind="after",
        replacement="dsv4_sm80.stages.dense:log_load_summary",
        reason="One line per GPU after loading: tensors converted, bytes before/after, seconds.",
        upstream="srt/model_loader/loader.py:804-849",
    ),
    # --- moe (moe.py): routed experts stay MXFP4; W4A8 on INT8 tensor cores or SGLang's Marlin ----------
    Seam(
        name="moe.quant_method",
        target="sglang.srt.layers.quantization.fp8:Fp8Config.get_quant_method",
        kind="around",
        replacement="dsv4_sm80.stages.moe:select_moe_method",
        reason=(
            "With SGLANG_DSV4_MXFP4_MOE_BACKEND=mxfp4_int8 the FP4 experts get the W4A8 method (INT8 "
            "tensor cores, 4-bit resident) instead of SGLang's MXFP4 Marlin method."
        ),
        upstream="srt/layers/quantization/fp8.py:336-399",
    ),
    Seam(
        name="moe.marlin_sm80",
        target="sglang.srt.layers.quantization.mxfp4_marlin_moe:is_sm90_supported",
        kind="value",
        replacement="dsv4_sm80.stages.moe:marlin_on_sm80",
        reason=(
            "SGLang's MXFP4 Marlin MoE is SM80-legal code refused by one Python check "
            "(mxfp4_marlin_moe.py:118); the marlin backend needs it lifted. Only that module's global "
            "changes, not is_sm90_supported elsewhere."
        ),
        upstream="srt/layers/quantization/mxfp4_marlin_moe.py:12",
    ),
    Seam(
        name="moe.footprint",
        target="sglang.srt.model_loader.loader:DefaultModelLoader.load_weights_and_postprocess",
        kind="after",
        replacement="dsv4_sm80.stages.moe:log_expert_footprint",
        reason="A start-up line per GPU: expert bytes resident, which must be 4 bits + E8M0 per 32.",
        upstream="srt/model_loader/loader.py:804-849",
    ),
    # --- attention (attention.py): BF16 KV, INT8 indexer, Triton sparse attention --------------------------
    Seam(
        name="attention.pool_bytes_per_token",
        target="sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4SingleKVPool.get_bytes_per_token",
        kind="replace",
        replacement="dsv4_sm80.stages.attention:bf16_bytes_per_token",
        reason="A KV row is 512 BF16 values (1024 bytes), not the 584-byte FP8 FlashMLA layout.",
        upstream="srt/mem_cache/deepseek_v4_memory_pool.py:98-105",
    ),
    Seam(
        name="attention.pool_create_buffer",
        target="sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4SingleKVPool.create_buffer",
        kind="replace",
        replacement="dsv4_sm80.stages.attention:bf16_create_buffer",
        reason=("The SWA/C4/C128 pools (target and draft) become BF16 [pages, page_size*512]: row = flat slot id, "
                "the id space of all metadata; the original asserts the FP8 layout."),
        upstream="srt/mem_cache/deepseek_v4_memory_pool.py:107-124",
    ),
    Seam(
        name="attention.pool_set_key_buffer",
        target="sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4SingleKVPool.set_key_buffer",
        kind="replace",
        replacement="dsv4_sm80.stages.attention:bf16_set_key_buffer",
        reason="The FP8 pack writer (Triton float8e4nv) cannot run on SM80; rows are BF16 here.",
        upstream="srt/mem_cache/deepseek_v4_memory_pool.py:126-137",
    ),
    Seam(
        name="attention.pool_set_key_buffer_fused",
        target="sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4SingleKVPool.set_key_buffer_fused",
        kind="replace",
        replacement="dsv4_sm80.stages.attention:bf16_set_key_buffer_fused",
        reason="The JIT FP8 FlashMLA store becomes a BF16 row scatter that skips slot < 0.",
        upstream="srt/mem_cache/deepseek_v4_memory_pool.py:139-150",
    ),
    Seam(
        name="attention.swa_norm_rope_store",
        target="sglang.srt.mem_cache.deepseek_v4_memory_pool:DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope",
        kind="replace",
        replacement="dsv4_sm80.stages.attention:bf16_swa_norm_rope_store",
        reason="The main K writer (RMSNorm + RoPE + FP8 FlashMLA page store) becomes RMSNorm + RoPE + BF16 row store.",
        upstream="srt/mem_cache/deepseek_v4_memory_pool.py:1177-1196",
    ),
    Seam(
        name="attention.pool_sizing",
        target="sglang.srt.model_executor.pool_configurator:DSV4PoolConfigurator._get_bytes_per_full_token",
        kind="around",
        replacement="dsv4_sm80.stages.attention:bf16_bytes_per_full_token",
        reason="The configurator hard-codes the 584-byte FP8 row; max_total_num_tokens must be sized for 1024.",
        upstream="srt/model_executor/pool_configurator.py:672-712",
    ),
    Seam(
        name="attention.compress_store",
        target="sglang.srt.layers.attention.dsv4.compressor_v2:compress_norm_rope_store",
        kind="around",
        replacement="dsv4_sm80.stages.attention:compress_store",
        reason=("Compressed entries: the main store through the JIT's own bf16_store mode into BF16 rows; the "
                "indexer store (FP8 in 0.5.16, no BF16/INT8 mode) through the INT8 epilogue+store."),
        upstream="srt/layers/attention/dsv4/compressor_v2.py:11",
    ),
    Seam(
        name="attention.indexer_q",
        target="sglang.srt.layers.attention.dsv4.indexer:fused_q_indexer_rope_hadamard_quant",
        kind="around",
        replacement="dsv4_sm80.stages.attention:indexer_q_int8",
        reason="Indexer Q: RoPE + Hadamard + INT8 (the JIT quantizes to FP8 for DeepGEMM).",
        upstream="srt/layers/attention/dsv4/indexer.py:11",
    ),
    Seam(
        name="attention.indexer_logits",
        target="sglang.srt.layers.attention.dsv4.indexer:fp8_paged_mqa_logits_torch",
        kind="around",
        replacement="dsv4_sm80.stages.attention:indexer_logits_int8",
        reason=("The paged weighted-ReLU MQA logits (DeepGEMM, SM90+) on INT8 tensor cores; SGLang calls this "
                "module global when SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 (an import-time default of the patch)."),
        upstream="srt/layers/attention/dsv4/indexer.py:55-118",
    ),
    Seam(
        name="attention.indexer_topk",
        target="sglang.srt.layers.attention.dsv4.indexer:topk_transform_512",
        kind="around",
        replacement="dsv4_sm80.stages.attention:indexer_topk_by_chunks",
        reason=("SGLang scores every query of a forward before its top-k: [T, L/4] fp32, 4 GiB a layer for an "
                "8192-token chunk at 512K (indexer.py:702-761). Logits above a 256 MiB budget are scored and top-k'd "
                "in query chunks."),
        upstream="srt/layers/attention/dsv4/indexer.py:12",
    ),
    Seam(
        name="attention.indexer_topk_torch",
        target="sglang.srt.layers.attention.dsv4.indexer:topk_transform_512_pytorch_vectorized",
        kind="around",
        replacement="dsv4_sm80.stages.attention:indexer_topk_by_chunks",
        reason="The same query chunks for the torch top-k SGLANG_TOPK_TRANSFORM_512_TORCH=1 selects.",
        upstream="srt/layers/attention/dsv4/indexer.py:248-331",
    ),
    Seam(
        name="attention.no_flashmla_metadata",
        target="sglang.srt.layers.attention.deepseek_v4_backend:_create_flashmla_metadata",
        kind="replace",
        replacement="dsv4_sm80.stages.attention:no_flashmla_metadata",
        reason="FlashMLA's scheduler metadata is read only by the FlashMLA call the SM80 forward replaces.",
        upstream="srt/layers/attention/deepseek_v4_backend.py:136-141",
    ),
    Seam(
        name="attention.forward",
        target="sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend.forward",
        kind="replace",
        replacement="dsv4_sm80.stages.attention:sm80_forward",
        reason=("FlashMLA sparse decode/prefill ship sm_90a/100a code only; one Triton kernel over the BF16 caches "
                "serves every mode from the backend's own per-query metadata (multi-step, DSPARK and NextN "
                "backends are instances of this class)."),
        upstream="srt/layers/attention/deepseek_v4_backend.py:1600-1755",
    ),
    Seam(
        name="attention.no_sparse_prefill",
        target="sglang.srt.layers.attention.deepseek_v4_backend:DeepseekV4AttnBackend._forward_prefill_sparse",
        kind="replace",
        replacement="dsv4_sm80.stages.attention:refuse_sparse_prefill",
        reason="FlashMLA sparse prefill over an FP8 workspace; unreachable with the SM80 forward, and kept so.",
        upstream="srt/layers/attention/deepseek_v4_backend.py:1757-1862",
    ),
    # --- mhc (mhc.py): the hyper-connection pre-norm GEMM ------------------------------------------------
    Seam(
        name="mhc.hc_prenorm_gemm",
        target="sglang.srt.layers.deep_gemm_wrapper.entrypoint:tf32_hc_prenorm_gemm",
        kind="replace",
        replacement="dsv4_sm80.stages.mhc:hc_prenorm_gemm",
        reason=("mhc_pre (every layer, and the load-time prewarm) calls DeepGEMM's TF32 hc pre-norm GEMM, built for "
                "SM90/SM100 only (SGLANG_OPT_DEEPGEMM_HC_PRENORM defaults on): a Triton GEMM on SM80's TF32 "
                "tensor cores with the same contract; its callers import this attribute when they run."),
        upstream="srt/layers/deep_gemm_wrapper/entrypoint.py:214-223",
    ),
    # --- requests (requests.py): checks SGLang leaves out, at the tokenizer manager -------------------------
    Seam(
        name="requests.input_ids_range",
        target="sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request",
        kind="around",
        replacement="dsv4_sm80.stages.requests:validate_one_request",
        reason=("Caller-supplied input_ids outside [0, vocab) reach DSV4's embedding and hash-layer table "
                "unchecked in 0.5.16 and a device-side assert kills the server; they are answered 400 naming "
                "input_ids.range instead."),
        upstream="srt/managers/tokenizer_manager.py:983-1064",
    ),
)


@dataclass(frozen=True)
class ServerArg:
    """A stage's rule on one of SGLang's server arguments: a value in `sets` is replaced at launch by the value it
    maps to, a value in `runs` is kept, any other is refused by the gate (check `name`)."""
    name: str  # stage.what, the gate's check
    attr: str  # the ServerArgs field
    flag: str  # its launch_server flag
    default: str  # SGLang's default, for a command line that does not name the flag
    sets: Mapping[str, str]
    runs: tuple[str, ...]
    why: str  # what the stage needs and why
    upstream: str  # where SGLang decides it, "srt/...py:LINE"

    def value(self, server_args) -> str:
        v = getattr(server_args, self.attr, None)
        return self.default if v is None or v == "" else str(v)


SERVER_ARGS: tuple[ServerArg, ...] = (
    # --- moe: both expert backends build on SGLang's MXFP4 parameter layout; tensor parallelism only -------
    ServerArg(
        name="moe.runner_backend", attr="moe_runner_backend", flag="--moe-runner-backend", default="auto",
        sets={"auto": "marlin"}, runs=("marlin",),
        why=("both SM80 expert backends build on SGLang's MXFP4 parameter layout, which only the marlin MoE runner "
             "backend selects (auto would pick the Triton FP8 path, which cannot run on SM80)"),
        upstream="srt/layers/quantization/fp8.py:371",
    ),
    ServerArg(
        name="moe.expert_parallel", attr="ep_size", flag="--ep-size", default="1", sets={}, runs=("1",),
        why=("tensor parallelism only: SGLang 0.5.16's expert-parallel MoE paths (DeepEP, Marlin without an expert "
             "map) need SM90 kernels, and model construction would raise NotImplementedError deep inside FusedMoE"),
        upstream="srt/layers/moe/fused_moe_triton/layer.py:104",
    ),
    ServerArg(
        name="moe.a2a_backend", attr="moe_a2a_backend", flag="--moe-a2a-backend", default="none", sets={},
        runs=("none",), why="tensor parallelism only: every all-to-all backend is an expert-parallel path (SM90)",
        upstream="srt/layers/moe/fused_moe_triton/layer.py:104-144",
    ),
    # --- attention: the KV cache is BF16 -----------------------------------------------------------------
    ServerArg(
        name="attention.kv_cache_dtype", attr="kv_cache_dtype", flag="--kv-cache-dtype", default="auto",
        sets={"auto": "bfloat16", "fp8_e4m3": "bfloat16"}, runs=("bfloat16",),
        why=("SM80 has no FP8: DSV4's KV cache rows are BF16, 1024 bytes a token and layer instead of 584 (SGLang's "
             "DSV4 default fp8_e4m3 is set at import, arg_groups/overrides.py:1463, so it is replaced at launch)"),
        upstream="srt/arg_groups/overrides.py:1463",
    ),
)


def by_module(seams=SEAMS) -> dict[str, list[Seam]]:
    out: dict[str, list[Seam]] = {}
    for s in seams:
        out.setdefault(s.module, []).append(s)
    return out


def validate_table(seams=SEAMS, fingerprints=None, lab_knobs=()) -> list[str]:
    """Problems with the declarations themselves (not with the installed SGLang). A lab seam's toggles may name
    the lab's knobs (`lab_knobs`, dsv4_lab.knobs.LAB_KNOBS; those the applier took from the lab by default)."""
    from .upstream import FINGERPRINTS, module_relpath

    fingerprints = FINGERPRINTS if fingerprints is None else fingerprints
    product_knobs = {k.name for k in env.KNOBS}
    lab_knob_names = product_knobs | {k.name for k in (*env.lab_knobs(), *lab_knobs)}
    problems, names = [], set()
    for s in seams:
        if s.name in names:
            problems.append(f"{s.name}: declared twice")
        names.add(s.name)
        if s.kind not in KINDS:
            problems.append(f"{s.name}: kind {s.kind!r} not in {KINDS}")
        if ":" not in s.target or ":" not in s.replacement:
            problems.append(f"{s.name}: target and replacement must be 'module:attr'")
            continue
        if module_relpath(s.module) != s.upstream_file:
            problems.append(f"{s.name}: upstream {s.upstream} is not the target's file {module_relpath(s.module)}")
        if s.upstream_file not in fingerprints:
            problems.append(f"{s.name}: no 0.5.16 fingerprint for {s.upstream_file}")
        if s.kind == "replace" and sum(x.replacement == s.replacement for x in seams) > 1:
            problems.append(f"{s.name}: replacement {s.replacement} is shared (it carries the seam's mark)")
        if not s.reason.strip():
            problems.append(f"{s.name}: no reason")
        if s.overlay not in OVERLAYS:
            problems.append(f"{s.name}: overlay {s.overlay!r} is not one of {', '.join(OVERLAYS)}")
        for cond in s.when:
            name, _, value = cond.partition("=")
            if name not in (lab_knob_names if s.overlay == "lab" else product_knobs) or not value:
                problems.append(f"{s.name}: toggle {cond!r} is not KNOB=value of dsv4_sm80.env"
                                + (" or the lab's knobs" if s.overlay == "lab" else ""))
    return problems


def order_problems(seams=SEAMS) -> list[str]:
    """The product table's order rule: one contiguous block per stage, in STAGES order, each seam named for its
    stage and replaced from that stage's file."""
    problems, seen = [], []
    for s in seams:
        stage = s.name.split(".", 1)[0]
        if stage not in STAGES:
            problems.append(f"{s.name}: {stage!r} is not one of the stages {', '.join(STAGES)}")
            continue
        if not s.replacement.startswith(f"dsv4_sm80.stages.{stage}:"):
            problems.append(f"{s.name}: replacement {s.replacement} is not in dsv4_sm80/stages/{stage}.py")
        if seen and seen[-1] == stage:
            continue
        if stage in seen:
            problems.append(f"{s.name}: a second {stage} block (after {seen[-1]})")
        elif seen and STAGES.index(stage) < STAGES.index(seen[-1]):
            problems.append(f"{s.name}: the {stage} block comes after {seen[-1]}, against STAGES")
        seen.append(stage)
    return problems
