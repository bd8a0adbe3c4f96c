"""The attention stage's wiring (dsv4_sm80/stages/attention.py) inside real SGLang 0.5.16 on the CPU: BF16 pools,
their writers, the pool sizing, the compressor's INT8 index store from a compress plan, and the backend's
forward on DSV4's own metadata object - each against the plain-PyTorch references. Kernels run in Triton's
interpreter."""

from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, dev, last_json, run_python
from dsv4_sm80.kernels import kv_store_ref as ref

pytestmark = pytest.mark.sglang


def test_scatter_rows_skips_negative_slots():
    from dsv4_sm80.kernels.kv_store import scatter_rows

    src = torch.randn(5, 512).to(torch.bfloat16)
    cache = dev(torch.zeros(8, 512, dtype=torch.bfloat16))
    scatter_rows(dev(src), dev(torch.tensor([2, -1, 7, 0, -5], dtype=torch.int64)), cache)
    cache = cache.cpu()
    assert torch.equal(cache[2], src[0]) and torch.equal(cache[7], src[2]) and torch.equal(cache[0], src[3])
    assert (cache[[1, 3, 4, 5, 6]] == 0).all()


def _plan_rows(rows):
    """16-byte plan rows as SGLang's planners write them: u32 seq_len, then (prefill) u16 ragged_id."""
    out = torch.zeros(len(rows), 4, dtype=torch.int32)
    for i, (seq, ragged) in enumerate(rows):
        out[i, 0] = seq
        out[i, 1] = ragged
    return out


@pytest.mark.parametrize("decode", [True, False], ids=["decode-plan", "prefill-plan"])
def test_compress_store_index_k_int8_follows_the_plan(decode):
    from dsv4_sm80.kernels.indexer_int8 import compress_store_index_k_int8

    g = torch.Generator().manual_seed(11)
    if decode:  # one row per request: stores only where seq_len completes a block of 4
        rows = [(8, 0), (9, 0), (4, 0), (13, 0)]
        out_loc = torch.tensor([70, 71, 3, 99], dtype=torch.int64)
        slots = [70, None, 3, None]
    else:  # one row per compress event; slot = out_loc[ragged_id]; padding rows have seq_len -1
        rows = [(8, 5), (-1, 0), (4, 1), (12, 2)]
        out_loc = torch.tensor([0, 9, 130, 0, 0, 64], dtype=torch.int64)
        slots = [64, None, 9, 130]
    kv = torch.randn(len(rows), 128, generator=g) * 3
    w = torch.rand(128, generator=g) + 0.5
    f = torch.polar(torch.ones(64, 32), torch.rand(64, 32, generator=g) * 6.28)
    cache = dev(torch.zeros(3, 64 * 132, dtype=torch.uint8))
    compress_store_index_k_int8(dev(kv), dev(_plan_rows(rows)), decode, dev(out_loc), dev(w), 1e-6, dev(f), cache)
    cache = cache.cpu()
    written = [s for s in slots if s is not None]
    for r, slot in enumerate(slots):
        if slot is None:
            continue
        y = ref.k_norm_rope_ref(kv[r:r + 1], w, 1e-6, f, torch.tensor([rows[r][0] - 4]))
        want_q, want_s = ref.int8_rows(y @ ref.hadamard128().T / 128 ** 0.5)
        got_q, got_s = ref.index_pages_read(cache, torch.tensor([slot]))
        assert (got_q.int() - want_q.int()).abs().max() <= 1, r
        assert torch.allclose(got_s.double(), want_s, rtol=1e-5), r
    vals, _ = ref.index_pages_read(cache, torch.tensor([s for s in range(3 * 64) if s not in written]))
    assert (vals == 0).all()  # nothing else was written


POOL = """
import json, torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool
out = {}
def make(dtype):
    return DeepSeekV4SingleKVPool(size=300, page_size=64, dtype=dtype, qk_nope_head_dim=448, qk_rope_head_dim=64,
                                  layer_num=2, device="cpu", enable_memory_saver=False)
pool = make(torch.bfloat16)
buf = pool.kv_buffer[1]
out["buffer"] = [str(buf.dtype), list(buf.shape)]
out["bytes_per_token"] = pool.get_bytes_per_token()
out["total_dim"] = pool.kv_cache_total_dim
rows = torch.randn(3, 512).to(torch.bfloat16)
pool.set_key_buffer_fused(1, torch.tensor([5, -1, 200]), rows)
flat = pool.get_key_buffer(1).view(-1, 512)
out["stored"] = bool(torch.equal(flat[5], rows[0]) and torch.equal(flat[200], rows[2]))
out["others_zero"] = (flat != 0).any(dim=1).nonzero().flatten().tolist() == [5, 200]
try:
    make(torch.float8_e4m3fn)
    out["fp8"] = "accepted"
except Exception as e:
    out["fp8"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_bf16_pool_in_real_sglang():
    out = last_json(run_python(POOL, ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    assert out["buffer"] == ["torch.bfloat16", [5, 64 * 512]]  # (300 + 64 + 1) // 64 pages, as upstream sizes them
    assert out["bytes_per_token"] == 1024 and out["total_dim"] == 512
    assert out["stored"] and out["others_zero"]
    assert out["fp8"].startswith("ValueError: dsv4-sm80 attention.kv_pool: found KV cache dtype torch.float8_e4m3fn")


SIZING = """
import json
from types import SimpleNamespace
import sglang.srt.model_executor.pool_configurator as pc
fn = pc.DSV4PoolConfigurator._get_bytes_per_full_token
flash = SimpleNamespace(qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, c4_ring_size=8,
                        swa_page_size=128, c4_shrink_factor=1, swa_ratio=0.1, num_layers_total=43,
                        num_layers_ca4=21, num_layers_ca128=20)
print(json.dumps({"patched": round(fn(flash), 1), "original": round(getattr(fn, "__wrapped__", fn)(flash), 1)}))
"""


def test_pool_sizing_uses_the_bf16_row():
    """DSV4-Flash geometry (43 layers: 21 C4, 20 C128, SWA ratio 0.1): 7,705.5 bytes per full token with the
    FP8 row, 11,976.2 with the BF16 row (+55 %)."""
    out = last_json(run_python(SIZING, ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    assert out == {"patched": 11976.2, "original": 7705.5}


FORWARD = """
import json, sys, torch
sys.path.insert(0, {root!r})
from sglang.srt.layers.attention import deepseek_v4_backend as B
from dsv4_sm80.kernels.sparse_attn_ref import sparse_attn_ref
g = torch.Generator().manual_seed(3)
T, H, HPAD = 5, 20, 32
def ids(w, slots):
    x = torch.randint(0, slots, (T, w), generator=g, dtype=torch.int32)
    x[torch.rand(T, w, generator=g) < 0.2] = -1
    return x
swa = torch.randn(40, 512, generator=g).to(torch.bfloat16)
extra = torch.randn(30, 512, generator=g).to(torch.bfloat16)
core = B.DSV4AttnMetadata.__new__(B.DSV4AttnMetadata)
core.swa_page_indices, core.swa_topk_lengths = ids(64, 40), torch.tensor([64, 3, 0, 17, 64], dtype=torch.int32)
core.c4_sparse_page_indices = ids(64, 30)
core.c4_sparse_topk_lengths = torch.tensor([64, 1, 5, 0, 9], dtype=torch.int32)
core.c128_page_indices, core.c128_topk_lengths_clamp1 = ids(64, 30)[:3], torch.tensor([2, 1, 64], dtype=torch.int32)
class Pool:
    def get_swa_key_buffer_radix(self, l): return swa.view(1, -1)
    def get_extra_key_buffer(self, l): return extra.view(1, -1)
backend = B.DeepseekV4AttnBackend.__new__(B.DeepseekV4AttnBackend)
backend.mtp_enabled, backend.softmax_scale, backend.token_to_kv_pool = False, 512 ** -0.5, Pool()
backend.forward_metadata = type("M", (), {{"core_attn_metadata": core}})()
layer = type("L", (), {{"layer_id": 0, "tp_q_head_num": H, "v_head_dim": 512}})()
q = torch.randn(T, HPAD, 512, generator=g).to(torch.bfloat16)
sink = torch.randn(HPAD, generator=g)
out = {{}}
for ratio, (e_ids, e_lens) in ((0, (None, None)), (4, (core.c4_sparse_page_indices, core.c4_sparse_topk_lengths)),
                               (128, (core.c128_page_indices, core.c128_topk_lengths_clamp1))):
    o = B.DeepseekV4AttnBackend.forward(backend, q, q, q, layer, None, ratio, save_kv_cache=False, attn_sink=sink)
    if e_ids is not None and e_ids.shape[0] < T:  # match_num_queries pads extra rows with id -1, length 1
        e_ids = torch.cat([e_ids, e_ids.new_full((T - e_ids.shape[0], e_ids.shape[1]), -1)])
        e_lens = torch.cat([e_lens, e_lens.new_ones(T - e_lens.shape[0])])
    want = sparse_attn_ref(q[:, :H], swa, core.swa_page_indices, core.swa_topk_lengths,
                           extra if e_ids is not None else None, e_ids, e_lens, sink[:H])
    err = (o[:, :H].double() - want).abs().max().item()
    out[str(ratio)] = [list(o.shape), str(o.dtype), err <= 1e-2 * want.abs().max().item()]
try:
    B.DeepseekV4AttnBackend._forward_prefill_sparse(backend, q)
    out["prefill_sparse"] = "reached"
except RuntimeError as e:
    out["prefill_sparse"] = str(e)
out["flashmla_metadata"] = B._create_flashmla_metadata()
print(json.dumps(out))
"""


def test_backend_forward_on_dsv4_metadata():
    """The patched DeepseekV4AttnBackend.forward on DSV4's own metadata object, for ratio 0, 4 and 128 (a
    C128 list with fewer rows than queries is padded as the backend pads it), against the reference."""
    root = REPO
    out = last_json(run_python(FORWARD.format(root=root), ENABLE_SGLANG_DSV4_A100_PATCH="1", TRITON_INTERPRET="1"))
    for ratio in ("0", "4", "128"):
        assert out[ratio] == [[5, 32, 512], "torch.bfloat16", True], (ratio, out[ratio])
    assert out["prefill_sparse"].startswith("dsv4-sm80 attention: FlashMLA sparse prefill was reached")
    assert out["flashmla_metadata"] is None


def test_the_stages_rule_keeps_the_kv_cache_bf16():
    from dsv4_sm80.gate import checks as cc
    from dsv4_sm80.seams import SERVER_ARGS

    rule = next(r for r in SERVER_ARGS if r.name == "attention.kv_cache_dtype")
    for given in ("auto", "fp8_e4m3", "bfloat16"):
        args = SimpleNamespace(kv_cache_dtype=given)
        assert cc.check_server_arg(rule, args).status == "pass"
        assert cc.server_arg_settings(args).get("kv_cache_dtype", given) == "bfloat16"
    f = cc.check_server_arg(rule, SimpleNamespace(kv_cache_dtype="fp8_e5m2"))
    assert f.line().startswith("FAIL attention.kv_cache_dtype: found --kv-cache-dtype fp8_e5m2"), f.line()


INDEXER = """
import json
import sglang.srt.layers.attention.dsv4.indexer as idx
import sglang.srt.layers.attention.dsv4.compressor_v2 as cmp
import sglang.srt.layers.attention.deepseek_v4_backend as B
mark = lambda f: getattr(f, "__dsv4_sm80_seam__", None)
print(json.dumps({"q": mark(idx.fused_q_indexer_rope_hadamard_quant), "logits": mark(idx.fp8_paged_mqa_logits_torch),
                  "store": mark(cmp.compress_norm_rope_store), "forward": mark(B.DeepseekV4AttnBackend.forward),
                  "metadata": mark(B._create_flashmla_metadata)}))
"""


def test_seams_route_the_indexer_and_backend():
    on = last_json(run_python(INDEXER, ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    assert on == {"q": "attention.indexer_q", "logits": "attention.indexer_logits", "store": "attention.compress_store",
                  "forward": "attention.forward", "metadata": "attention.no_flashmla_metadata"}, on
    off = last_json(run_python(INDEXER, ENABLE_SGLANG_DSV4_A100_PATCH="0"))
    assert set(off.values()) == {None}, off
