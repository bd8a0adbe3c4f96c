"""Lab: native SGLang's FP8 roundings replayed on the SM80 datapath (DSV4_SM80_LAB_NATIVE_ROUNDING).

The H200 parity run of 2026-11-30 (docs/results/README.md, `steps.sh parity` at d49c3dc) put the patched path 2-5x the
native noise floor from native, with the dense mode and the expert backend making no difference. What every SM80
combination shares against native is precision, not arithmetic. On SM90 with default arguments native rounds in three
places a BF16 path does not (read from the 0.5.16 sources; file:line into the wheel):

- kv: each cached key row (SWA and compressed; the same row serves as value) keeps its nope part, 448 values,
  as FP8 e4m3 with a power-of-two scale per 64: s = 2^ceil(log2(max(amax, 1e-4) / 448)), x / s clamped to
  +-448 and cast round-to-nearest-even (jit_kernel csrc main_norm_rope.cuh:261-354 for SWA, which quantizes
  the fp32 normed value; fused_norm_rope_v2.cuh:372-499 for C4/C128, which rounds to BF16 first). The rope
  part stays BF16. Replayed here on the BF16 rows the SM80 path stored, exactly (e4m3 times a power of two is
  a BF16 value), for the compressed rows (native rounds those to BF16 first too); the SWA rows are recomputed
  in fp32 from the store's inputs and quantized from fp32 as native does (`swa_rows`): rounding their BF16 rows
  instead is a double rounding that moves 3 % of the values one FP8 step (a BF16 value on an e4m3 midpoint, 1
  in 16, half of them rounded the other way), 1.6e-2 relative, most of the FP8 rounding's own 2.6e-2 (2026-12-02,
  `steps.sh trace` at 6bc4ecc; the module trace saw it as layer 0's attention output 2.0e-2 from native against a 4e-3
  floor).
- act: the input of every FP8 block linear that DeepGEMM runs (wqkv_a, wq_b, wo_b, indexer wq_b, shared experts; not
  wo_a, a BF16 einsum on SM90 unless SGLANG_OPT_FP8_WO_A_GEMM=1) is quantized per token and 128 columns with a plain
  fp32 scale amax / 448 (floor 1e-10; UE8M0 only on SM100: deep_gemm_wrapper/configurer.py:35-38,
  fp8_utils.py:820-826), and the product accumulates in fp32 with the exact weight. Replayed in `fp8_act_linear` (fp32
  GEMM of the dequantized activation; slow, for the lab), on a GPU through SGLang's own quantizer (`native_act`; on
  2026-12-01 `steps.sh trace-linears` at 8ce119d measured the model `fp8_act` 2-3e-3 from native per linear, SGLang's
  quantizer 7-9e-4: what is left is DeepGEMM's accumulation).
- gemm: instead of act, each of those linears through native's own FP8 block linear: SGLang's dispatch
  (`dispatch_w8a8_block_fp8_linear`, DeepGEMM on SM90) on the checkpoint's FP8 weight and scale, kept beside the BF16
  weight. `steps.sh trace-linears` (2026-12-01, at 8ce119d) measured `act` (SGLang's quantizer, then an exact fp32
  product) 7-9e-4 from native per linear on identical inputs and native's own linear 0: gemm removes that last
  per-linear difference.
  With it the mHC pre-norm GEMM also runs DeepGEMM's own `tf32_hc_prenorm_gemm` (seam mhc.hc_prenorm_gemm; the SM80
  Triton GEMM is 1.9e-6 from it, which still flips a BF16 rounding of the pre-mix now and then: layer 0's first linear
  saw inputs 2.9e-5 apart). It calls DeepGEMM, so runs with the tripwire off (an SM90 GPU: the H200 only). With it
  (2026-12-02, `steps.sh trace` at feb413e with TRACE_RUNS naming gemm) layer 0's first linears are bit-equal to
  native's and every traced module sits at native's perturbation floor (docs/results/README.md).
- idx: the indexer's keys and queries are FP8 with an fp32 scale amax / 448 per 128 (against the SM80 path's
  INT8), scored in fp32 by DeepGEMM; it only changes which compressed entries the top-512 selection keeps,
  i.e. prompts past 2048 tokens. Replayed by running SGLang's own FP8 query kernel and FP8 index store (SM90
  code: on the H200 only) and `fp8_paged_logits` over that cache.

So a patched run with kv,act,idx compared with native has no precision choice left between them but rounding
order (and native's fast-math division): if the divergence then falls to the native floor, the rest of the
datapath is shown equal and the gap is the precision choices alone.

Lab only: never a default, never for serving; eager runs only.
"""

from __future__ import annotations

import functools
import sys

import torch

from . import knobs

HEAD_DIM = 512  # a main KV row: nope + rope
NOPE = 448  # of the 512-wide key row; the last 64 (rope) stay BF16 in native too
TILE = 64
FP8_MAX = 448.0
EPS = 1e-4  # main_norm_rope.cuh / fused_norm_rope_v2.cuh (the Triton quant_k_cache.py, unused here, has 1e-8)
ACT_GROUP = 128
ACT_EPS = 1e-10


def fp8_pow2_tiles(x: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """x [..., D] (D a multiple of tile) through native's key quantization and back, in x's dtype."""
    xf = x.float().unflatten(-1, (-1, tile))
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(EPS)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2).to(x.dtype)


def _eager_only(t: torch.Tensor) -> None:
    """The replays sync with the host and allocate as they go: refused inside a CUDA-graph capture."""
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("DSV4_SM80_LAB_NATIVE_ROUNDING is for eager runs: disable CUDA graphs for this experiment")


def kv_rows_(cache_rows: torch.Tensor, loc: torch.Tensor) -> None:
    """The rows at loc (>= 0) of a [slots, 512] BF16 key cache, their nope part rounded as native stores it."""
    _eager_only(cache_rows)
    loc = loc.reshape(-1).long()
    loc = loc[loc >= 0]
    if loc.numel() == 0:
        return
    cache_rows.index_copy_(0, loc, round_nope_(cache_rows.index_select(0, loc)))


def swa_rows(kv: torch.Tensor, weight: torch.Tensor, eps: float, freqs_cis: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor:
    """[N, 512] BF16 key rows as native's SWA store leaves them (jit main_norm_rope.cuh
    fused_k_norm_rope_flashmla), from that store's inputs: RMSNorm over all 512 with the weight in fp32, RoPE
    on the last 64 (interleaved pairs) in fp32 then BF16, the nope part quantized from fp32 (no BF16 rounding
    first) per 64 with a power-of-two scale. freqs_cis as the store gets it (complex [max_pos, 32] or its
    fp32 view)."""
    _eager_only(kv)
    from dsv4_sm80.kernels.common import rope_table

    x = kv.float()
    norm = torch.rsqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)
    data = x * norm * weight.float()
    f = rope_table(freqs_cis).float().reshape(freqs_cis.shape[0], -1, 2)[positions.long()]  # [N, 32, (cos, sin)]
    re, im = data[:, NOPE::2], data[:, NOPE + 1::2]
    rope = torch.stack([re * f[..., 0] - im * f[..., 1], re * f[..., 1] + im * f[..., 0]], dim=-1).flatten(-2)
    return torch.cat([fp8_pow2_tiles(data[:, :NOPE]), rope], dim=-1).to(torch.bfloat16)


def round_nope_(rows: torch.Tensor) -> torch.Tensor:
    """[N, 512] key rows (a tensor of their own), the nope part rounded as native stores it; returns rows."""
    rows[:, :NOPE] = fp8_pow2_tiles(rows[:, :NOPE])
    return rows


def fp8_act(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """x [..., K] (K a multiple of group) through native's activation quantization and back, in fp32: per
    token and group, scale amax / 448 (fp32, floor 1e-10), x * (448 / amax) clamped and cast to e4m3."""
    xf = x.float().unflatten(-1, (-1, group))
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(ACT_EPS)
    inv = torch.full_like(amax, FP8_MAX) / amax  # IEEE fp32 division (a scalar / tensor is reciprocal * scalar:
    # two roundings); native's kernel divides with fast math, so a value landing on a tie may round apart
    q = (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * (amax * (1.0 / FP8_MAX))).flatten(-2)


@functools.cache
def sglang_act_quantizer():
    """SGLang's own per-token-group FP8 activation quantizer (`sglang_per_token_group_quant_fp8`, what native's
    DeepGEMM block linear calls on SM90), or None where SGLang does not provide it. `python -m dsv4_lab.trace DIR
    --linears --sglang-models` on the H200 (2026-12-01): native's FP8 linear outputs are 2.1-3.4e-3 from `fp8_act`'s
    model but 6.8-9.0e-4 from SGLang's quantizer followed by the exact fp32 product (DeepGEMM's own product: 0), so
    the quantizer itself rounds differently from the model in a fraction of the elements."""
    try:
        from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_group_quant_fp8
    except ImportError:
        return None
    return sglang_per_token_group_quant_fp8


def sglang_act(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] through SGLang's own activation quantizer (group 128, fp32 scales: the arguments native passes
    on SM90) and back, in fp32. Raises where SGLang has no such quantizer or cannot run it (a CPU tensor)."""
    quant = sglang_act_quantizer()
    if quant is None:
        raise RuntimeError("SGLang's sglang_per_token_group_quant_fp8 is not importable")
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    q, s = quant(rows, ACT_GROUP)
    deq = (q.float().unflatten(-1, (-1, ACT_GROUP)) * s.float().unsqueeze(-1)).flatten(-2)
    return deq.reshape(x.shape)


def native_act(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as native's FP8 linear sees it, in fp32: on a GPU SGLang's own quantizer (`sglang_act`);
    elsewhere (the CPU), or without that quantizer, the model `fp8_act`."""
    if x.is_cuda and sglang_act_quantizer() is not None:
        return sglang_act(x)
    return fp8_act(x)


def fp8_act_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear with native's FP8 activation rounding (`native_act`): fp32 product of the dequantized activation
    and the exact (BF16) weight, cast to x's dtype once."""
    if x.shape[-1] % ACT_GROUP:
        raise ValueError(f"DSV4_SM80_LAB_NATIVE_ROUNDING=act: K={x.shape[-1]} is not a multiple of {ACT_GROUP}")
    out = torch.matmul(native_act(x), weight.float().t())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@functools.cache
def _items() -> frozenset:
    """Read once per process (the stores call this per layer; the environment does not change under a
    running server). Tests that change the knob call `_items.cache_clear()`."""
    raw = knobs.get(knobs.LAB_NATIVE_ROUNDING)
    chosen = frozenset() if raw == "0" else frozenset(raw.split(","))
    if chosen:  # once: the result is cached
        print(f"dsv4-sm80 LAB: DSV4_SM80_LAB_NATIVE_ROUNDING={raw}: native's FP8 roundings replayed "
              "(parity experiment; not a serving configuration)", file=sys.stderr, flush=True)
    return chosen


def kv_enabled() -> bool:
    return "kv" in _items()


def idx_enabled() -> bool:
    return "idx" in _items()


def fp8_paged_logits(q, kv_cache, weights, seq_lens, page_table, max_len: int, chunk: int = 64) -> torch.Tensor:
    """The indexer logits as native computes them (DeepGEMM fp8_paged_mqa_logits, fp32), from the FP8 index
    cache SGLang's own stores wrote: logits[t, j] = s_k[j] * sum_h w[t, h] * ReLU(q8[t, h] . k8[j]) for
    j < seq_lens[t], else 0. q [T, (1,) H, 128] FP8; kv_cache: pages of 64 x (128 FP8 + fp32 scale); weights
    [T, H] fp32 (the q scale folded in); page_table [T, pages]. Tokens in chunks (memory stays ~chunk x
    length x 128 x 4 bytes); a host sync per chunk: eager runs only."""
    t_total, heads = q.shape[0], q.shape[-2]
    qf = q.reshape(t_total, heads, 128).float()
    lens = seq_lens.reshape(-1).long()
    flat = kv_cache.view(torch.uint8).reshape(-1, 64 * 132)
    out = torch.zeros(t_total, max_len, dtype=torch.float32, device=q.device)
    for t0 in range(0, t_total, chunk):
        rows = slice(t0, min(t_total, t0 + chunk))
        n_max = int(lens[rows].max()) if t_total else 0
        if n_max <= 0:
            continue
        pages = -(-n_max // 64)
        g = flat[page_table[rows, :pages].clamp(min=0).long()]  # [c, pages, 64 * 132] bytes
        c = g.shape[0]
        k = g[..., :64 * 128].contiguous().view(torch.float8_e4m3fn).float().reshape(c, pages * 64, 128)
        s_k = g[..., 64 * 128:].contiguous().view(torch.float32).reshape(c, pages * 64)
        dots = torch.einsum("chd,cjd->chj", qf[rows], k)
        logit = (torch.relu(dots) * weights[rows].reshape(c, heads, 1).float()).sum(1) * s_k
        j = torch.arange(pages * 64, device=q.device)
        logit = logit.masked_fill(j[None, :] >= lens[rows, None], 0.0)
        width = min(pages * 64, max_len)
        out[rows, :width] = logit[:, :width]
    return out


def act_enabled() -> bool:
    return "act" in _items()


def gemm_enabled() -> bool:
    return "gemm" in _items()


# --- the lab seams (dsv4_lab/seams.py): each wraps the product's replacement on the same SGLang target -------

def upstream(fn):
    """SGLang's own function under a chain of seam wrappers (each carries its seam's mark and keeps the one
    below as `__wrapped__`; SGLang's own decorators below that are left in place)."""
    from dsv4_sm80.apply import MARK

    while getattr(fn, MARK, None) is not None and getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def set_key_buffer(original, self, layer_id, loc, cache_k):
    """Around DeepSeekV4SingleKVPool.set_key_buffer(_fused) (the product's BF16 row store): with kv, the rows'
    nope part rounded as native stores it (512-wide main rows; the indexer's rows are not these)."""
    if kv_enabled() and isinstance(cache_k, torch.Tensor) and cache_k.shape[-1] == HEAD_DIM:
        cache_k = round_nope_(cache_k.reshape(-1, HEAD_DIM).clone())
    return original(self, layer_id, loc, cache_k)


def swa_norm_rope_store(original, self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions):
    """Around DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope: with kv, native quantizes these
    rows from fp32, not from their BF16 rounding, so they are recomputed here (`swa_rows`) and scattered."""
    if not kv_enabled():
        return original(self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions)
    from dsv4_sm80.kernels.kv_store import scatter_rows

    buf = self.swa_kv_pool.kv_buffer[self._swa_local_layer_id(layer_id)]
    scatter_rows(swa_rows(kv, kv_weight, eps, freqs_cis, positions), swa_loc, buf)
    return None


def compress_store(original, kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size,
                   use_fp4=False, bf16_store=False):
    """Around compressor_v2.compress_norm_rope_store: with kv, the main compressor's rows rounded after the
    product stored them (idempotent: rows out_loc names but the call left alone are unchanged); with idx, the
    indexer's entries through SGLang's own FP8 store into the same 132-byte pages (SM90 only)."""
    args = dict(norm_weight=norm_weight, norm_eps=norm_eps, freq_cis=freq_cis, out_loc=out_loc, kvcache=kvcache,
                page_size=page_size, use_fp4=use_fp4, bf16_store=bf16_store)
    if kv.shape[-1] != HEAD_DIM and idx_enabled() and not use_fp4:
        return upstream(original)(kv, plan, **{**args, "bf16_store": False})
    out = original(kv, plan, **args)
    if kv.shape[-1] == HEAD_DIM and kv_enabled():
        kv_rows_(kvcache.view(torch.bfloat16).reshape(-1, HEAD_DIM), out_loc)
    return out


def indexer_q(original, q, weight, weight_scale, freqs_cis, positions):
    """Around indexer.fused_q_indexer_rope_hadamard_quant: with idx, SGLang's own FP8 kernel (SM90 only)."""
    fn = upstream(original) if idx_enabled() else original
    return fn(q, weight, weight_scale, freqs_cis, positions)


def indexer_logits(original, q, kv_cache, weights, seq_lens, page_table, deep_gemm_metadata, max_seq_len,
                   clean_logits=False):
    """Around indexer.fp8_paged_mqa_logits_torch: with idx, fp32 logits over the FP8 cache SGLang's own stores
    wrote (`fp8_paged_logits`; SGLang's torch version gathers every token's whole cache at once and would not
    fit a long prefill)."""
    if idx_enabled():
        return fp8_paged_logits(q, kv_cache, weights, seq_lens, page_table, int(max_seq_len))
    return original(q, kv_cache, weights, seq_lens, page_table, deep_gemm_metadata, max_seq_len,
                    clean_logits=clean_logits)


def hc_prenorm_gemm(original, x, fn, out, sqrsum, num_splits):
    """Around deep_gemm_wrapper.entrypoint.tf32_hc_prenorm_gemm (the product's Triton GEMM): with gemm,
    DeepGEMM's own GEMM as upstream calls it (SM90; the tripwire off), so a replay's layers start from native's
    exact pre-mix."""
    if not gemm_enabled():
        return original(x, fn, out, sqrsum, num_splits)
    if x.shape[0]:
        import deep_gemm

        deep_gemm.tf32_hc_prenorm_gemm(x, fn, out, sqrsum, num_splits=num_splits)
    return None


def replay_linear(method):
    """The product's BF16 linear method (`Sm80Bf16LinearMethod`) made to replay native: with gemm it keeps the
    checkpoint's FP8 weight and scale beside the BF16 weight (`layer.lab_fp8`, the loaded tensors themselves)
    and runs native's own FP8 block linear on them (SGLang's dispatch, DeepGEMM on SM90); with act the input
    takes native's activation rounding (`fp8_act_linear`). Instance attributes: the class stays the product's."""
    if gemm_enabled():
        load = method.process_weights_after_loading

        def process_weights_after_loading(layer):
            kept = layer.weight.data, layer.weight_scale_inv.data
            load(layer)
            layer.lab_fp8 = kept

        def apply(layer, x, bias=None):
            weight, scale = layer.lab_fp8
            return method.w8a8_block_fp8_linear(input=x, weight=weight, block_size=method.weight_block_size,
                                                weight_scale=scale, input_scale=None, bias=bias)

        method.process_weights_after_loading = process_weights_after_loading
        method.apply = apply
    elif act_enabled():
        method.apply = lambda layer, x, bias=None: fp8_act_linear(x, layer.weight, bias)
    return method


def linear_method(original, self, layer, prefix):
    """Around Fp8Config.get_quant_method, after the dense and MoE stages: their BF16 linear method replays
    native's linear (`replay_linear`) when act or gemm is chosen."""
    method = original(self, layer, prefix)
    if type(method).__name__ == "Sm80Bf16LinearMethod" and (act_enabled() or gemm_enabled()):
        return replay_linear(method)
    return method
