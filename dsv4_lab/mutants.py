"""Lab fault injection: named mutants, each one small deliberate bug in the SM80 serving path.

A measure of accuracy is only worth something if it catches real bugs. `DSV4_SM80_LAB_MUTANT=<name>` switches on
exactly one mutant; each is one or a few `around` seams (overlay "lab") on the attribute the SM80 path really
calls, so the bug sits where an SM80 port would put it. Where the product already replaces that attribute
(`attention.forward`, `dense.wo_a_fp8_param`), the applier chains the lab seam over the product's replacement.
Every wrapper also checks the knob when it runs and otherwise calls the original untouched, so a wrapper left
applied with another mutant named (or none) changes nothing. Weight mutants act on the loaded parameters in
memory, after the model's own post-load step and before the quant methods' `process_weights_after_loading`;
no checkpoint file is ever written. Lab only: never for serving.

Where each lives (file:line in SGLang 0.5.16, relative to the sglang package):

  routed_scaling_dropped   srt/models/deepseek_v2.py:1129 (the MoE combine: the marlin backend applies the
                           factor there) and srt/layers/moe/fused_moe_triton/layer.py:181 (FusedMoE's runner
                           config: the W4A8 method multiplies by it in dsv4_sm80.stages.moe's apply)
  e8m0_exponent_off        srt/models/deepseek_v4.py:2575 (post_load_weights): the first FP8 block linear's
                           scale block [0, 0] doubled (E8M0 exponent + 1), before its BF16/Marlin conversion
  mxfp4_nibble_swap        srt/models/deepseek_v4.py:2575: expert 0 of the first MoE layer, w13 and w2 bytes with
                           their two E2M1 codes swapped, before the W4A8/Marlin repack
  swa_window_127/129       srt/layers/attention/deepseek_v4_backend.py:1927 (make_core_attn_metadata): the
                           causal SWA index lists the SM80 forward reads
  compressed_visibility_off_by_one
                           srt/layers/attention/deepseek_v4_backend.py:294 (_init_compression_metadata_triton):
                           C4/C128 entry counts from seq_len + 1, so an entry is visible one position early
  indexer_topk_511         srt/layers/attention/dsv4/indexer.py:754 (topk_transform_512)
  kv_store_skip_last       srt/layers/attention/deepseek_v4_backend.py:1556 (get_swa_out_cache_loc): the SWA
                           K store's slot of each request's last token of an extend chunk is -1 (skipped)
  attn_sink_dropped        srt/layers/attention/deepseek_v4_backend.py:1600 (forward; dsv4_sm80.stages.attention's
                           sm80_forward underneath): the per-head sink -> float32 min, exp(sink) = 0
  compressed_rope_theta    srt/models/deepseek_v4.py:525-545 (MqaAttentionBase.__init__): compressed layers
                           build their RoPE table with rope_theta instead of compress_rope_theta
  router_bias_on_weights   srt/layers/moe/topk.py:1983 (select_experts): weights = (scores + correction bias)
                           at the chosen experts, renormalized
  tid2eid_by_position      srt/models/deepseek_v4.py:1545 (DeepseekV4DecoderLayer.forward): the MoE gets the
                           positions where the token ids go, so hash layers look up tid2eid[position]
  sinkhorn_19              kernels/ops/layernorm/mhc.py:782 (mhc_pre, also the load-time prewarm): 19
                           Sinkhorn iterations instead of the config's hc_sinkhorn_iters (20)
  image_patches_transposed srt/managers/mm_utils.py:1194 (general_mm_embed_routine): each image's patches
                           reach the ViT column by column while its grid says row by row
  image_window_one_short   srt/models/deepseek_v4.py:2250 (DeepseekV4Model.forward): the image spans of the
                           bidirectional window end one token early
  bias_vl_on_text_rows     srt/layers/moe/topk.py:484 and hash_topk.py:180: text rows of a batch with images
                           route by bias_vl too
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from dataclasses import dataclass

import torch

from dsv4_sm80.env import Knob
from dsv4_sm80.seams import Seam

KNOB = "DSV4_SM80_LAB_MUTANT"
# DSV4_SM80_LAB_MUTANT=runtime applies every RUNTIME mutant's seams at once and leaves the choice to this file,
# read at every call: one engine serves the clean run and each mutant in turn (the accuracy bed writes it)
RUNTIME = "runtime"
SWITCH_FILE = "DSV4_SM80_LAB_MUTANT_FILE"
_switch: dict = {}


def active() -> str:
    """The mutant on now ("" when none): the switch file's content when DSV4_SM80_LAB_MUTANT_FILE is set, else the
    knob; read at every call, not at import."""
    path = os.environ.get(SWITCH_FILE)
    if not path:
        return os.environ.get(KNOB, "").strip()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ""
    key = (st.st_ino, st.st_mtime_ns, st.st_size)  # the writer replaces the file whole: a new inode each time
    if _switch.get("key") != key:
        with open(path) as f:
            _switch.update(key=key, name=f.read().strip())
    return _switch["name"]


def _bug(name: str):
    """An `around` replacement that is the named bug only while DSV4_SM80_LAB_MUTANT=name."""

    def wrap(fn):
        @functools.wraps(fn)
        def gated(original, *args, **kwargs):
            if active() != name:
                return original(*args, **kwargs)
            return fn(original, *args, **kwargs)

        gated.mutant = name
        return gated

    return wrap


def _bind(original, args, kwargs) -> inspect.BoundArguments:
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def _call(original, args, kwargs, **changes):
    """original(*args, **kwargs) with the named parameters replaced, wherever the caller put them."""
    bound = _bind(original, args, kwargs)
    bound.arguments.update(changes)
    return original(*bound.args, **bound.kwargs)


# --- MoE -----------------------------------------------------------------------------------------

@_bug("routed_scaling_dropped")
def combine_without_scaling(original, *args, **kwargs):
    """Around deepseek_v2.maybe_fuse_routed_scale_and_shared_add: the routed output joins the shared one
    unscaled (marlin backend; for other methods that function does not scale)."""
    return _call(original, args, kwargs, routed_scaling_factor=1.0)


@_bug("routed_scaling_dropped")
def experts_without_scaling(original, *args, **kwargs):
    """Around FusedMoE.__init__: the runner config carries no routed scaling factor (the W4A8 method then
    multiplies by 1.0)."""
    return _call(original, args, kwargs, routed_scaling_factor=None)


@_bug("router_bias_on_weights")
def bias_on_weights(original, *args, **kwargs):
    """Around topk.select_experts: the same experts, combined with (scores + correction bias) weights."""
    bound = _bind(original, args, kwargs)
    out = original(*bound.args, **bound.kwargs)
    cfg = bound.arguments["topk_config"]
    if cfg.correction_bias is None:
        return out
    logits = bound.arguments["router_logits"].float()
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()
    w = (scores + cfg.correction_bias.float()).gather(1, out.topk_ids.long().clamp(min=0))
    if cfg.renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    if cfg.apply_routed_scaling_factor_on_output:
        w = w * cfg.routed_scaling_factor
    return out._replace(topk_weights=w.to(out.topk_weights.dtype))


@_bug("tid2eid_by_position")
def positions_as_token_ids(original, *args, **kwargs):
    """Around DeepseekV4DecoderLayer.forward: the MoE is handed the positions as its token ids (the decoder
    layer uses input_ids for nothing else)."""
    positions = _bind(original, args, kwargs).arguments["positions"]
    return _call(original, args, kwargs, input_ids=positions, input_ids_global=positions)


@_bug("sinkhorn_19")
def sinkhorn_19(original, *args, **kwargs):
    """Around mhc.mhc_pre: 19 Sinkhorn iterations, whatever the layer asks for."""
    return _call(original, args, kwargs, sinkhorn_repeat=19)


# --- weights, after load and before the quant methods convert them ---------------------------------

def _first(model, has, what: str):
    found = next((m for _, m in model.named_modules() if has(m)), None)
    if found is None:
        raise RuntimeError(f"dsv4_lab mutant {active()}: found no {what} in {type(model).__name__}; expected the "
                           "DSV4 model this mutant edits; unset DSV4_SM80_LAB_MUTANT for this model")
    return found


@_bug("e8m0_exponent_off")
def scale_exponent_plus_one(original, *args, **kwargs):
    """Around DeepseekV4ForCausalLM.post_load_weights (target model only): the first FP8 block linear's
    scale of block [0, 0] gets exponent + 1 (x2), so that 128x128 weight block doubles."""
    out = original(*args, **kwargs)
    bound = _bind(original, args, kwargs)
    if not bound.arguments["is_nextn"]:
        layer = _first(bound.arguments["self"], lambda m: isinstance(getattr(m, "weight_scale_inv", None), torch.Tensor)
                       and getattr(m, "weight", None) is not None and m.weight.dtype == torch.float8_e4m3fn,
                       "FP8 block linear")
        scale = layer.weight_scale_inv.data
        if scale.dtype == torch.float8_e8m0fnu:
            scale.view(torch.uint8)[0, 0] += 1
        else:
            scale[0, 0] *= 2
    return out


@_bug("mxfp4_nibble_swap")
def swap_expert_nibbles(original, *args, **kwargs):
    """Around DeepseekV4ForCausalLM.post_load_weights (target model only): expert 0 of the first MoE layer
    reads its MXFP4 bytes high nibble first (each byte's two E2M1 codes swapped), in w13 and w2."""
    out = original(*args, **kwargs)
    bound = _bind(original, args, kwargs)
    if not bound.arguments["is_nextn"]:
        layer = _first(bound.arguments["self"], lambda m: isinstance(getattr(m, "w13_weight", None), torch.Tensor),
                       "MoE layer")
        for w in (layer.w13_weight, layer.w2_weight):
            b = w.data[0].view(torch.uint8)
            b.copy_((b << 4) | (b >> 4))
    return out


# --- attention -------------------------------------------------------------------------------------

SWA_WINDOW = 128  # deepseek_v4_backend.SWA_WINDOW


@_bug("swa_window_127")
def swa_window_127(original, *args, **kwargs):
    """Around make_core_attn_metadata: causal SWA lists keep 127 keys (entry j is key p - j: the oldest goes)."""
    md = original(*args, **kwargs)
    if _bind(original, args, kwargs).arguments["dspark_block_size"] is None:
        md.swa_topk_lengths = torch.clamp(md.swa_topk_lengths, max=SWA_WINDOW - 1)
    return md


@_bug("swa_window_129")
def swa_window_129(original, *args, **kwargs):
    """Around make_core_attn_metadata: causal SWA lists rebuilt by SGLang's own builder with a 129-key window
    (one key older than the model sees). The lists are wider than the CUDA-graph buffers: eager runs only."""
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    md = original(*args, **kwargs)
    a = _bind(original, args, kwargs).arguments
    if a["dspark_block_size"] is None:
        md.swa_page_indices = backend.BuildCausalSwaPageIndices.execute(
            req_to_token=a["self"].req_to_token,
            full_to_swa_mapping=a["self"].token_to_kv_pool.full_to_swa_index_mapping,
            req_pool_indices_repeated=a["req_pool_indices_repeated"], seq_lens_casual=md.seq_lens_casual,
            swa_window=SWA_WINDOW + 1, page_index_aligned_size=backend.PAGE_INDEX_ALIGNED_SIZE)
        md.swa_topk_lengths = torch.clamp(md.seq_lens_casual, max=SWA_WINDOW + 1)
    return md


@_bug("compressed_visibility_off_by_one")
def compressed_visible_early(original, seq_lens, positions, raw_out_loc, *args, **kwargs):
    """Around deepseek_v4_backend._init_compression_metadata_triton: where entries are written stays right,
    how many each query sees (C4 and C128 counts, C128 index lists) is computed from seq_len + 1, so an entry
    is visible one position before its last token."""
    right = original(seq_lens, positions, raw_out_loc, *args, **kwargs)
    early = original(seq_lens + 1, positions, raw_out_loc, *args, **kwargs)
    return (*right[:2], *early[2:4], *right[4:6], *early[6:])


@_bug("indexer_topk_511")
def indexer_topk_511(original, scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices=None):
    """Around indexer.topk_transform_512: a row that selected all 512 slots loses its lowest-scoring one. Only
    where the logits fit one pass (the product's query chunks hand on unscored arguments above its budget)."""
    if not torch.is_tensor(scores):
        raise RuntimeError("mutant indexer_topk_511: the indexer logits were deferred to query chunks (a prompt past "
                           "the stage's LOGITS_BUDGET_BYTES); run this mutant on shorter prompts")
    raw = torch.empty_like(out_page_indices) if out_raw_indices is None else out_raw_indices
    original(scores, seq_lens, page_tables, out_page_indices, page_size, raw)
    valid = out_page_indices >= 0
    picked = torch.where(valid, scores.gather(1, raw.long().clamp(min=0)), float("inf"))
    full = valid.sum(dim=1, keepdim=True) == out_page_indices.shape[1]
    col = torch.arange(out_page_indices.shape[1], device=raw.device)[None, :]
    drop = full & (col == picked.argmin(dim=1, keepdim=True))  # no host sync: CUDA-graph safe
    out_page_indices.masked_fill_(drop, -1)
    raw.masked_fill_(drop, -1)


@_bug("kv_store_skip_last")
def swa_loc_skip_last(original, self, forward_batch):
    """Around DeepseekV4AttnBackend.get_swa_out_cache_loc: in an extend, each request's last token of the
    chunk gets slot -1, which every SM80 store skips; its SWA key row is never written."""
    loc = original(self, forward_batch)
    if not forward_batch.forward_mode.is_extend_without_speculative() or forward_batch.extend_start_loc is None:
        return loc
    last = (forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1).long()
    return loc.index_fill(0, last, -1)


@_bug("attn_sink_dropped")
def sink_dropped(original, *args, **kwargs):
    """Around DeepseekV4AttnBackend.forward: the sink is float32's minimum, so exp(sink) adds nothing to the
    softmax denominator (the SM80 forward refuses a missing sink, so it cannot simply be None)."""
    bound = _bind(original, args, kwargs)
    sink = bound.arguments["attn_sink"]
    if sink is not None:
        bound.arguments["attn_sink"] = torch.full_like(sink, torch.finfo(torch.float32).min)
    return original(*bound.args, **bound.kwargs)


@_bug("compressed_rope_theta")
def compressed_rope_theta(original, *args, **kwargs):
    """Around MqaAttentionBase.__init__: the layer sees a config whose compress_rope_theta is rope_theta, so
    compressed (C4/C128) layers rotate q, k and their compressed entries at the SWA layers' base."""
    from sglang.srt.models.deepseek_v4 import get_rope_config

    config = _bind(original, args, kwargs).arguments["config"]
    wrong = copy.copy(config)
    wrong.compress_rope_theta = get_rope_config(config)[0]
    return _call(original, args, kwargs, config=wrong)


# --- Vision-Exp (the backport's seams underneath; DSV4_SM80_VISION=1) --------------------------------------

class _ColumnMajorPatches:
    """An image item whose patches come column by column while its grid still says rows of n_vit_w."""

    def __init__(self, item):
        self._item = item

    def __getattr__(self, name):
        return getattr(self._item, name)

    @property
    def feature(self):
        f, h, w = self._item.feature, self._item.n_vit_h, self._item.n_vit_w
        return f.reshape(h, w, *f.shape[1:]).transpose(0, 1).reshape(f.shape)


@_bug("image_patches_transposed")
def patches_transposed(original, *args, **kwargs):
    """Around mm_utils.general_mm_embed_routine: the image embedding function gets each item's patches in
    column-major order (a square grid is the image transposed: left/right becomes top/bottom)."""
    bound = _bind(original, args, kwargs)
    funcs = dict(bound.arguments.get("data_embedding_funcs") or {})
    for modality, fn in funcs.items():
        funcs[modality] = lambda items, _fn=fn: _fn([_ColumnMajorPatches(it) for it in items])
    bound.arguments["data_embedding_funcs"] = funcs
    return original(*bound.args, **bound.kwargs)


@_bug("image_window_one_short")
def image_window_one_short(original, *args, **kwargs):
    """Around DeepseekV4Model.forward: the image spans the bidirectional window reads end one token early, so
    no image query sees its block's last token (IMAGE_END) unless it is that token's own causal key."""
    fb = _bind(original, args, kwargs).arguments["forward_batch"]
    spans = getattr(fb, "dsv4_image_spans", None)
    if not spans:
        return original(*args, **kwargs)
    fb.dsv4_image_spans = [[(s, e - 1) for s, e in req or ()] for req in spans]
    try:
        return original(*args, **kwargs)
    finally:
        fb.dsv4_image_spans = spans


def _all_rows_image(original, args, kwargs):
    from vision_backport import routing

    mask = routing._IMAGE_MASK
    if mask is None:
        return original(*args, **kwargs)
    routing._IMAGE_MASK = torch.ones_like(mask)
    try:
        return original(*args, **kwargs)
    finally:
        routing._IMAGE_MASK = mask


@_bug("bias_vl_on_text_rows")
def bias_vl_all_rows_topk(original, *args, **kwargs):
    """Around TopK.forward_cuda: in a batch with image rows, the text rows route by bias_vl too."""
    return _all_rows_image(original, args, kwargs)


@_bug("bias_vl_on_text_rows")
def bias_vl_all_rows_hash(original, *args, **kwargs):
    """Around HashTopK.forward: the same on the hash layers (text rows leave the token table for bias_vl)."""
    return _all_rows_image(original, args, kwargs)


# --- the table -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mutant:
    name: str
    stage: str  # the datapath stage the bug sits in (an accuracy run must catch bugs of several)
    doc: str  # one line: the bug and where it lives
    seams: tuple[Seam, ...]
    runtime: bool  # switchable per call in a running engine (DSV4_SM80_LAB_MUTANT=runtime)


# per-call wrappers on targets no other runtime mutant wraps; load- and init-time bugs (weights, RoPE tables, the
# runner config) and the second SWA width need an engine of their own
_RUNTIME = {"swa_window_127", "compressed_visibility_off_by_one", "indexer_topk_511", "kv_store_skip_last",
            "attn_sink_dropped", "router_bias_on_weights", "tid2eid_by_position", "sinkhorn_19",
            "image_patches_transposed", "image_window_one_short", "bias_vl_on_text_rows"}


def _seam(mutant: str, part: str, target: str, replacement, reason: str, upstream: str) -> Seam:
    when = f"{KNOB}={mutant}" + (f"|{RUNTIME}" if mutant in _RUNTIME else "")
    return Seam(name=f"mutant.{mutant}" + (f".{part}" if part else ""), target=target, kind="around",
                replacement=f"{__name__}:{replacement.__name__}", reason=reason, upstream=upstream,
                when=(when,), overlay="lab")


def _mutant(name: str, stage: str, doc: str, *seams: tuple) -> Mutant:
    return Mutant(name, stage, doc, tuple(_seam(name, *s) for s in seams), name in _RUNTIME)


_BACKEND = "sglang.srt.layers.attention.deepseek_v4_backend"
_V4 = "sglang.srt.models.deepseek_v4"

_LIST = (
    _mutant("routed_scaling_dropped", "moe",
            "MoE output without the routed scaling factor (1.5): deepseek_v2's combine and FusedMoE's runner config",
            ("combine", "sglang.srt.models.deepseek_v2:maybe_fuse_routed_scale_and_shared_add", combine_without_scaling,
             "Marlin backend: the routed output is scaled where it joins the shared experts.",
             "srt/models/deepseek_v2.py:122"),
            ("runner", "sglang.srt.layers.moe.fused_moe_triton.layer:FusedMoE.__init__", experts_without_scaling,
             "W4A8 backend: the method multiplies by the runner config's factor.",
             "srt/layers/moe/fused_moe_triton/layer.py:181-303")),
    _mutant("e8m0_exponent_off", "dense",
            "one UE8M0 scale exponent + 1 (block [0, 0] of the first FP8 dense linear), after load, before conversion",
            ("", f"{_V4}:DeepseekV4ForCausalLM.post_load_weights", scale_exponent_plus_one,
             "The model's post-load step runs after its weights load and before the loader's "
             "process_weights_after_loading converts FP8 linears.", "srt/models/deepseek_v4.py:2575-2594")),
    _mutant("mxfp4_nibble_swap", "moe",
            "MXFP4 nibble order swapped in expert 0 of the first MoE layer (w13, w2), after load, before the repack",
            ("", f"{_V4}:DeepseekV4ForCausalLM.post_load_weights", swap_expert_nibbles,
             "The expert bytes are still the checkpoint's here; both expert backends repack them afterwards.",
             "srt/models/deepseek_v4.py:2575-2594")),
    _mutant("swa_window_127", "attention",
            "sliding window 127 instead of 128 in the causal SWA lists (make_core_attn_metadata)",
            ("", f"{_BACKEND}:DeepseekV4AttnBackend.make_core_attn_metadata", swa_window_127,
             "Every forward mode builds its SWA lists here (SWA_WINDOW = 128).",
             "srt/layers/attention/deepseek_v4_backend.py:1927-2002")),
    _mutant("swa_window_129", "attention",
            "sliding window 129 instead of 128 in the causal SWA lists (eager runs only)",
            ("", f"{_BACKEND}:DeepseekV4AttnBackend.make_core_attn_metadata", swa_window_129,
             "Every forward mode builds its SWA lists here (SWA_WINDOW = 128).",
             "srt/layers/attention/deepseek_v4_backend.py:1927-2002")),
    _mutant("compressed_visibility_off_by_one", "attention",
            "C4/C128 entries visible one position early (counts from seq_len + 1; _init_compression_metadata_triton)",
            ("", f"{_BACKEND}:_init_compression_metadata_triton", compressed_visible_early,
             "The per-query compressed entry counts and C128 lists of DSV4AttnMetadata.init_compression_metadata.",
             "srt/layers/attention/deepseek_v4_backend.py:26")),
    _mutant("indexer_topk_511", "indexer", "the C4 indexer keeps 511 entries instead of 512 (topk_transform_512)",
            ("", "sglang.srt.layers.attention.dsv4.indexer:topk_transform_512", indexer_topk_511,
             "The SM80 path's top-k over the INT8 indexer logits (v1 JIT; v2 is sm_90+).",
             "srt/layers/attention/dsv4/indexer.py:12")),
    _mutant("kv_store_skip_last", "kv store",
            "the SWA K store skipped for each request's last token of an extend chunk (get_swa_out_cache_loc)",
            ("", f"{_BACKEND}:DeepseekV4AttnBackend.get_swa_out_cache_loc", swa_loc_skip_last,
             "The slots every SWA K store of a forward writes (deepseek_v4.py:692).",
             "srt/layers/attention/deepseek_v4_backend.py:1556-1580")),
    _mutant("attn_sink_dropped", "attention",
            "attention sink not applied (exp(sink) = 0) in the SM80 attention forward",
            ("", f"{_BACKEND}:DeepseekV4AttnBackend.forward", sink_dropped,
             "Wraps the product's sm80_forward, which passes the sink to the sparse attention kernel.",
             "srt/layers/attention/deepseek_v4_backend.py:1600-1755")),
    _mutant("compressed_rope_theta", "attention",
            "compressed layers' RoPE at rope_theta (10000) instead of compress_rope_theta (MqaAttentionBase.__init__)",
            ("", f"{_V4}:MqaAttentionBase.__init__", compressed_rope_theta,
             "The layer's freqs_cis (q, k, compressor, indexer) is built from the config here.",
             "srt/models/deepseek_v4.py:378-545")),
    _mutant("router_bias_on_weights", "moe",
            "router correction bias added to the combine weights, not only to the selection (select_experts)",
            ("", "sglang.srt.layers.moe.topk:select_experts", bias_on_weights,
             "The non-hash layers' top-k (TopK.forward_cuda calls this module global).",
             "srt/layers/moe/topk.py:1983-2165")),
    _mutant("tid2eid_by_position", "moe",
            "hash routing looks up tid2eid by position instead of token id (DeepseekV4DecoderLayer.forward)",
            ("", f"{_V4}:DeepseekV4DecoderLayer.forward", positions_as_token_ids,
             "input_ids reach HashTopK through the decoder layer (deepseek_v2.py:1058-1067).",
             "srt/models/deepseek_v4.py:1545-1673")),
    _mutant("sinkhorn_19", "mhc", "mHC Sinkhorn with 19 iterations instead of hc_sinkhorn_iters = 20 (mhc_pre)",
            ("", "sglang.kernels.ops.layernorm.mhc:mhc_pre", sinkhorn_19,
             "hc_pre (TileLang path, the SM80 default) and the load-time prewarm call this module global.",
             "kernels/ops/layernorm/mhc.py:782-988")),
    _mutant("image_patches_transposed", "vision",
            "image patches column-major over a row-major ViT grid (general_mm_embed_routine's embedding function)",
            ("", "sglang.srt.managers.mm_utils:general_mm_embed_routine", patches_transposed,
             "The VL model hands its image embedding function to this module global (vision_backport/model.py).",
             "srt/managers/mm_utils.py:1194-1290")),
    _mutant("image_window_one_short", "vision",
            "the bidirectional image window ends one token before IMAGE_END (the spans DeepseekV4Model.forward sees)",
            ("", f"{_V4}:DeepseekV4Model.forward", image_window_one_short,
             "The attention layers under this forward read the spans the VL model put on the batch.",
             "srt/models/deepseek_v4.py:2250-2300")),
    _mutant("bias_vl_on_text_rows", "vision",
            "bias_vl applied to the text rows of a batch with images too (TopK.forward_cuda, HashTopK.forward)",
            ("topk", "sglang.srt.layers.moe.topk:TopK.forward_cuda", bias_vl_all_rows_topk,
             "The non-hash layers' top-k; the backport's vision.topk re-routes the image rows under it.",
             "srt/layers/moe/topk.py:484-500"),
            ("hash", "sglang.srt.layers.moe.hash_topk:HashTopK.forward", bias_vl_all_rows_hash,
             "The hash layers' top-k; the backport's vision.hash_topk re-routes the image rows under it.",
             "srt/layers/moe/hash_topk.py:180-200")),
)

MUTANTS: dict[str, Mutant] = {m.name: m for m in _LIST}

MUTANT_KNOB = Knob(
    KNOB, "", ("", *MUTANTS, RUNTIME),
    "Lab (fault injection): one named deliberate bug in the SM80 serving path (dsv4_lab/mutants.py), to check "
    f"that an accuracy measure catches it; {RUNTIME}: every per-call mutant wrapped, the one on named by the file "
    f"${SWITCH_FILE} at each call. Unset: none. Never for serving.",
)

MUTANT_SEAMS: tuple[Seam, ...] = tuple(s for m in _LIST for s in m.seams)
