"""The lab's named mutants (dsv4_lab/mutants.py): each seam targets a real attribute of SGLang 0.5.16, and each
wrapper, run over the real original on tiny inputs, is exactly its bug with its knob set and bit-identical
otherwise. Mutants whose effect only shows in a full forward (sinkhorn_19: TileLang kernel; the W4A8 half of
routed_scaling_dropped, compressed_rope_theta: layer construction) are shown changing what they pass on."""

import importlib
import inspect
import os
from types import SimpleNamespace

import pytest
import torch

from dsv4_lab import mutants as M
from dsv4_sm80.upstream import FINGERPRINTS, locate_sglang, module_relpath

pytestmark = pytest.mark.sglang

KNOB = "DSV4_SM80_LAB_MUTANT"
NAMED = ("routed_scaling_dropped", "e8m0_exponent_off", "mxfp4_nibble_swap", "swa_window_127", "swa_window_129",
         "compressed_visibility_off_by_one", "indexer_topk_511", "kv_store_skip_last", "attn_sink_dropped",
         "compressed_rope_theta", "router_bias_on_weights", "tid2eid_by_position", "sinkhorn_19",
         "image_patches_transposed", "image_window_one_short", "bias_vl_on_text_rows")


@pytest.fixture
def knob(monkeypatch):
    """knob(name) sets the mutant; knob(None) unsets it."""
    def set_(name):
        if name is None:
            monkeypatch.delenv(KNOB, raising=False)
        else:
            monkeypatch.setenv(KNOB, name)
    return set_


def _other(name):
    return next(n for n in NAMED if n != name)


def _replacement(seam):
    mod, _, attr = seam.replacement.partition(":")
    return getattr(importlib.import_module(mod), attr)


# --- declarations (the product validator does not know overlay "lab" yet) -------------------------

def test_every_seam_declares_a_real_target():
    assert set(NAMED) <= set(M.MUTANTS) and M.MUTANT_KNOB.choices == ("", *M.MUTANTS, "runtime")
    assert M.MUTANT_KNOB.name == KNOB and M.MUTANT_KNOB.default == ""
    assert M.MUTANT_SEAMS == tuple(s for m in M.MUTANTS.values() for s in m.seams)
    pkg = locate_sglang()
    names = set()
    for m in M.MUTANTS.values():
        assert m.doc.strip() and "\n" not in m.doc and m.seams, m.name
        for s in m.seams:
            assert s.name not in names and s.name.startswith(f"mutant.{m.name}")
            names.add(s.name)
            when = f"{KNOB}={m.name}" + ("|runtime" if m.runtime else "")
            assert (s.kind, s.overlay, s.when) == ("around", "lab", (when,)), s.name
            assert s.reason.strip()
            # the target exists and is defined where the applier looks (vars of its owner)
            owner = importlib.import_module(s.module)
            for part in s.attr_path[:-1]:
                owner = getattr(owner, part)
            assert s.attr_path[-1] in vars(owner), s.target
            # upstream is the target's fingerprinted file, and the cited lines name the attribute
            assert module_relpath(s.module) == s.upstream_file and s.upstream_file in FINGERPRINTS, s.name
            lo, _, hi = s.upstream.split(":", 1)[1].partition("-")
            lines = open(os.path.join(pkg, s.upstream_file)).read().splitlines()[int(lo) - 1:int(hi or lo)]
            assert any(s.attr_path[-1] in line for line in lines), (s.name, s.upstream)
            assert _replacement(s).mutant == m.name


@pytest.mark.parametrize("name", NAMED)
def test_wrappers_pass_through_unless_named(name, knob):
    sentinel = object()
    for other in (None, _other(name)):
        knob(other)
        for s in M.MUTANTS[name].seams:
            seen = []

            def original(*a, _seen=seen, **k):
                return _seen.append((a, k)) or sentinel

            out = _replacement(s)(original, 1, x=2)
            assert out is sentinel and seen == [((1,), {"x": 2})]


# --- MoE -----------------------------------------------------------------------------------------

def test_routed_scaling_dropped(knob):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.mxfp4_marlin_moe import Mxfp4MarlinMoEMethod
    from sglang.srt.models.deepseek_v2 import maybe_fuse_routed_scale_and_shared_add as combine

    marlin = SimpleNamespace(quant_method=object.__new__(Mxfp4MarlinMoEMethod))
    routed, shared = torch.randn(4, 16), torch.randn(4, 16)
    run = lambda sh: M.combine_without_scaling(combine, marlin, routed.clone(), sh, 1.5)  # noqa: E731
    knob(_other("routed_scaling_dropped"))
    right, right_shared = run(None), run(shared.clone())
    assert torch.equal(right, combine(marlin, routed.clone(), None, 1.5))
    knob("routed_scaling_dropped")
    assert torch.equal(run(None) * 1.5, right) and torch.equal(run(None), routed)  # exactly the factor
    assert torch.equal(run(shared.clone()), shared + routed) and not torch.equal(right_shared, shared + routed)

    # W4A8 backend: FusedMoE's runner config gets no factor (the method multiplies by `factor or 1.0`)
    got = {}

    def init(*a, **k):
        got.update(inspect.signature(FusedMoE.__init__).bind(*a, **k).arguments)
    init.__signature__ = inspect.signature(FusedMoE.__init__)
    M.experts_without_scaling(init, object(), 8, 64, 32, 3, top_k=2, routed_scaling_factor=1.5)
    assert got["routed_scaling_factor"] is None and got["top_k"] == 2


def test_router_bias_on_weights(knob, monkeypatch):
    from sglang.srt.layers.moe.topk import TopKConfig, select_experts

    monkeypatch.setenv("SGLANG_OPT_USE_JIT_KERNEL_FUSED_TOPK", "0")  # SGLang's torch top-k on CPU
    torch.manual_seed(0)
    logits, bias = torch.randn(6, 16), torch.rand(16) * 0.5
    cfg = TopKConfig(top_k=4, renormalize=True, correction_bias=bias, scoring_func="sqrtsoftplus")
    right = select_experts(torch.randn(6, 8), logits, cfg)
    knob(None)
    off = M.bias_on_weights(select_experts, hidden_states=torch.randn(6, 8), router_logits=logits, topk_config=cfg)
    assert torch.equal(off.topk_weights, right.topk_weights) and torch.equal(off.topk_ids, right.topk_ids)
    knob("router_bias_on_weights")
    bug = M.bias_on_weights(select_experts, torch.randn(6, 8), logits, cfg)
    assert torch.equal(bug.topk_ids, right.topk_ids)
    scores = torch.nn.functional.softplus(logits).sqrt()
    want = (scores + bias).gather(1, right.topk_ids.long())
    torch.testing.assert_close(bug.topk_weights, want / want.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(bug.topk_weights, right.topk_weights)


def test_tid2eid_by_position(knob, monkeypatch):
    from sglang.srt.layers.moe.hash_topk import HashTopK
    from sglang.srt.models.deepseek_v4 import DeepseekV4DecoderLayer

    monkeypatch.setenv("SGLANG_OPT_USE_FUSED_HASH_TOPK", "0")  # SGLang's torch hash routing on CPU
    torch.manual_seed(0)
    router = HashTopK(topk=2, num_experts=16, num_fused_shared_experts=0, vocab_size=64)
    with torch.no_grad():
        router.tid2eid.copy_(torch.randint(0, 16, (64, 2), dtype=torch.int32))
    logits, ids, positions = torch.randn(5, 16), torch.tensor([40, 7, 33, 2, 61]), torch.arange(10, 15)

    def layer_forward(self, positions, hidden_states, input_ids, forward_batch, input_ids_global, *prev):
        return router(hidden_states, logits, input_ids_global)  # what the MoE's hash top-k receives
    layer_forward.__signature__ = inspect.signature(DeepseekV4DecoderLayer.forward)

    run = lambda: M.positions_as_token_ids(layer_forward, None, positions=positions,  # noqa: E731
                                           hidden_states=torch.randn(5, 8), input_ids=ids, forward_batch=None,
                                           input_ids_global=ids)
    knob(None)
    assert torch.equal(run().topk_ids, router.tid2eid[ids])
    knob("tid2eid_by_position")
    assert torch.equal(run().topk_ids, router.tid2eid[positions])


def test_sinkhorn_19(knob):
    """Full forward only (TileLang kernel): here, the iterations mhc_pre is handed, as hc_pre and the prewarm
    pass them."""
    from sglang.kernels.ops.layernorm import mhc

    got = []

    def mhc_pre(*a, **k):
        got.append(inspect.signature(mhc.mhc_pre).bind(*a, **k).arguments["sinkhorn_repeat"])
    mhc_pre.__signature__ = inspect.signature(mhc.mhc_pre)
    args = (None,) * 8
    for name, want in ((None, 20), ("sinkhorn_19", 19)):
        knob(name)
        M.sinkhorn_19(mhc_pre, *args, 20, 1, 32)  # prewarm_mhc_pre: positional
        M.sinkhorn_19(mhc_pre, *args[:4], rms_eps=0, hc_pre_eps=0, hc_sinkhorn_eps=0, hc_post_mult_value=2,
                      sinkhorn_repeat=20)  # hc_pre: keywords
        assert got[-2:] == [want, want]


# --- weights -----------------------------------------------------------------------------------------

def _tiny_loaded_model(scale_dtype=torch.float32):
    """Module tree with what post_load_weights sees: an FP8 block linear (weight + scale) and an MXFP4 expert
    layer (checkpoint bytes), and an empty layer range so DSV4's own post-load step runs over nothing."""
    torch.manual_seed(0)
    root, model, lin, moe = (torch.nn.Module() for _ in range(4))
    model.start_layer = model.end_layer = 0
    model.layers = torch.nn.ModuleList()
    fp8 = (torch.randn(256, 256) * 0.3).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0 ** -3, 2.0 ** -4], [2.0 ** -5, 2.0 ** -6]]).to(scale_dtype)
    lin.weight = torch.nn.Parameter(fp8, requires_grad=False)
    lin.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
    for name, shape in (("w13_weight", (2, 64, 32)), ("w2_weight", (2, 64, 32))):
        setattr(moe, name, torch.nn.Parameter(torch.randint(0, 256, shape, dtype=torch.uint8), requires_grad=False))
        setattr(moe, name.replace("weight", "scale"), torch.randint(118, 130, (*shape[:2], shape[2] * 2 // 32),
                                                                    dtype=torch.uint8))
    model.attn_linear, model.experts = lin, moe
    root.model = model
    return root


@pytest.fixture
def post_load(monkeypatch):
    """DSV4's own post_load_weights, with the FP8 wo_a GEMM off as the SM80 path pins it at import."""
    from sglang.srt.models import deepseek_v4

    monkeypatch.setattr(deepseek_v4, "_FP8_WO_A_GEMM", False)
    return deepseek_v4.DeepseekV4ForCausalLM.post_load_weights


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_e8m0_exponent_off(knob, scale_dtype, post_load):

    from dsv4_sm80.stages.dense import to_bf16_blocks

    post = post_load
    right = _tiny_loaded_model(scale_dtype)
    lin = right.model.attn_linear
    want = to_bf16_blocks(lin.weight.data, lin.weight_scale_inv.data)
    for other in (None, _other("e8m0_exponent_off")):
        knob(other)
        m = _tiny_loaded_model(scale_dtype)
        M.scale_exponent_plus_one(post, m)
        assert torch.equal(to_bf16_blocks(m.model.attn_linear.weight.data, m.model.attn_linear.weight_scale_inv.data),
                           want)
    knob("e8m0_exponent_off")
    m = _tiny_loaded_model(scale_dtype)
    M.scale_exponent_plus_one(post, m, is_nextn=True)  # the MTP draft is left alone
    assert torch.equal(m.model.attn_linear.weight_scale_inv.data.float(), lin.weight_scale_inv.data.float())
    M.scale_exponent_plus_one(post, m)
    got = to_bf16_blocks(m.model.attn_linear.weight.data, m.model.attn_linear.weight_scale_inv.data)
    assert torch.equal(got[:128, :128], want[:128, :128] * 2)  # one exponent up: that block doubles, exactly
    got[:128, :128] = want[:128, :128]
    assert torch.equal(got, want)


def test_mxfp4_nibble_swap(knob, post_load):
    from dsv4_sm80.kernels.w4a8_moe_ref import dequant_mxfp4

    post = post_load
    right = _tiny_loaded_model().model.experts
    knob(_other("mxfp4_nibble_swap"))
    m = _tiny_loaded_model()
    M.swap_expert_nibbles(post, m)
    assert torch.equal(m.model.experts.w13_weight, right.w13_weight)
    knob("mxfp4_nibble_swap")
    M.swap_expert_nibbles(post, m)
    for name in ("w13", "w2"):
        w, w0 = getattr(m.model.experts, f"{name}_weight"), getattr(right, f"{name}_weight")
        s = getattr(right, f"{name}_scale")
        got, want = dequant_mxfp4(w[0], s[0]), dequant_mxfp4(w0[0], s[0])
        assert torch.equal(got[:, 0::2], want[:, 1::2]) and torch.equal(got[:, 1::2], want[:, 0::2])
        assert torch.equal(w[1], w0[1])  # the other experts untouched


# --- attention ---------------------------------------------------------------------------------------

def _swa_metadata(wrapper, monkeypatch, tokens=300):
    """SGLang's own make_core_attn_metadata (CPU builders) for one request prefilled from position 0, slot =
    position, through `wrapper`; returns each query's visible SWA key positions."""
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    from dsv4_sm80.kernels.sparse_attn_ref import valid_ids
    from dsv4_sm80.stages.attention import no_flashmla_metadata

    monkeypatch.setattr(backend, "_create_flashmla_metadata", no_flashmla_metadata)  # as the SM80 seam does
    req_to_token = torch.arange(512, dtype=torch.int32)[None]
    full_to_swa = torch.cat([torch.arange(512, dtype=torch.int64), torch.tensor([-1])])
    self = SimpleNamespace(swa_page_size=128, page_size=256, req_to_token=req_to_token, c4_topk=512,
                           token_to_kv_pool=SimpleNamespace(full_to_swa_index_mapping=full_to_swa),
                           cuda_int32_kwargs={"dtype": torch.int32, "device": "cpu"}, is_dspark_draft=False)
    md = wrapper(backend.DeepseekV4AttnBackend.make_core_attn_metadata, self, req_to_token,
                 torch.zeros(tokens, dtype=torch.int64), torch.arange(1, tokens + 1, dtype=torch.int32), 512,
                 torch.arange(tokens), need_compress=False)
    return [set(valid_ids(md.swa_page_indices[t], md.swa_topk_lengths[t]).tolist()) for t in range(tokens)]


@pytest.mark.parametrize("name", ["swa_window_127", "swa_window_129"])
def test_swa_window(name, knob, monkeypatch):
    wrapper = getattr(M, name)
    knob(_other(name))
    right = _swa_metadata(wrapper, monkeypatch)
    assert all(right[p] == set(range(max(0, p - 127), p + 1)) for p in range(len(right)))
    knob(name)
    bug = _swa_metadata(wrapper, monkeypatch)
    for p, (r, b) in enumerate(zip(right, bug)):
        if name == "swa_window_127":
            assert b == (r - {p - 127} if p >= 127 else r), p  # exactly the oldest key hidden
        else:
            assert b == (r | {p - 128} if p >= 128 else r), p  # exactly one older key shown


def test_compressed_visibility_off_by_one(knob):
    """SGLang's own metadata kernel (Triton, in the interpreter on CPU)."""
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    seq = torch.tensor([1, 2, 3, 4, 5, 7, 8, 126, 127, 128, 129, 255, 256], dtype=torch.int32)
    args = (seq, seq - 1, torch.arange(1000, 1000 + seq.numel(), dtype=torch.int64),
            torch.arange(2 * seq.numel(), dtype=torch.int32).view(-1, 2), 256, True)
    knob(_other("compressed_visibility_off_by_one"))
    right = M.compressed_visible_early(backend._init_compression_metadata_triton, *args)
    for a, b in zip(right, backend._init_compression_metadata_triton(*args)):
        assert torch.equal(a, b)
    knob("compressed_visibility_off_by_one")
    bug = M.compressed_visible_early(backend._init_compression_metadata_triton, *args)
    for i in (0, 1, 4, 5):  # where entries are written, and their positions: unchanged
        assert torch.equal(bug[i], right[i])
    assert torch.equal(bug[2], (seq + 1) // 4) and torch.equal(right[2], seq // 4)
    assert torch.equal(bug[6], (seq + 1) // 128) and torch.equal(right[6], seq // 128)
    assert torch.equal((bug[8] >= 0).sum(1), (seq + 1) // 128)  # C128 lists: one entry early at 127, 255


def test_indexer_topk_511(knob):
    """SGLang's own torch top-k transform stands in for the JIT one (same contract)."""
    from sglang.srt.layers.attention.dsv4.indexer import topk_transform_512_pytorch_vectorized as topk

    torch.manual_seed(0)
    seq = torch.tensor([300, 511, 512, 700], dtype=torch.int32)
    scores = torch.randn(4, 768)
    pages = torch.arange(12, dtype=torch.int32).expand(4, 12).contiguous()  # page p -> p: index = position

    def run():
        out = torch.empty(4, 512, dtype=torch.int32)
        M.indexer_topk_511(topk, scores, seq, pages, out, 64)
        return [set(r[r >= 0].tolist()) for r in out]

    knob(None)
    right = run()
    assert [len(r) for r in right] == [300, 511, 512, 512]
    knob("indexer_topk_511")
    bug = run()
    for r, b, n, s in zip(right, bug, seq.tolist(), scores):
        want = set(torch.topk(s[:n], min(n, 511)).indices.tolist())
        assert b == want and (b == r if n <= 511 else b < r and len(r - b) == 1)


def test_kv_store_skip_last(knob):
    """SGLang's own get_swa_out_cache_loc, then the product's SWA row store (Triton, interpreter)."""
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dsv4_sm80.kernels.kv_store import scatter_rows

    loc = torch.arange(20, 28, dtype=torch.int32)
    self = SimpleNamespace(forward_metadata=SimpleNamespace(core_attn_metadata=SimpleNamespace(swa_out_cache_loc=loc)))
    batch = SimpleNamespace(out_cache_loc=torch.arange(8), forward_mode=ForwardMode.EXTEND,
                            extend_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                            extend_seq_lens=torch.tensor([5, 3], dtype=torch.int32))
    original = DeepseekV4AttnBackend.get_swa_out_cache_loc
    knob(None)
    assert torch.equal(M.swa_loc_skip_last(original, self, batch), loc)
    knob("kv_store_skip_last")
    bug = M.swa_loc_skip_last(original, self, batch)
    assert bug.tolist() == [20, 21, 22, 23, -1, 25, 26, -1] and loc[4] == 24  # the cached tensor is untouched
    rows, cache = torch.randn(8, 512).bfloat16(), torch.zeros(32, 512, dtype=torch.bfloat16)
    scatter_rows(rows, bug, cache)
    assert torch.equal(cache[[20, 21, 22, 23, 25, 26]], rows[[0, 1, 2, 3, 5, 6]])
    assert not cache[[24, 27]].any()  # the chunks' last keys never stored
    batch.forward_mode = ForwardMode.DECODE
    assert torch.equal(M.swa_loc_skip_last(original, self, batch), loc)


def test_attn_sink_dropped(knob):
    """The product's Triton sparse attention (interpreter) is what the SM80 forward calls with the sink."""
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    from dsv4_sm80.kernels.sparse_attn import sparse_attn
    from dsv4_sm80.kernels.sparse_attn_ref import sparse_attn_ref

    torch.manual_seed(0)
    heads = 16
    q, cache = torch.randn(3, heads, 512).bfloat16(), torch.randn(40, 512).bfloat16()
    ids = torch.randint(0, 40, (3, 64), dtype=torch.int32)
    lens = torch.tensor([64, 9, 0], dtype=torch.int32)  # the last query sees no key at all
    sink = torch.randn(heads) * 2

    def forward(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=True, attn_sink=None, **_):
        return sparse_attn(q, cache, ids, lens, sink=attn_sink, scale=512 ** -0.5, heads=heads).float()
    forward.__signature__ = inspect.signature(DeepseekV4AttnBackend.forward)

    run = lambda: M.sink_dropped(forward, None, q=q, k=None, v=None, layer=None, forward_batch=None,  # noqa: E731
                                 compress_ratio=0, attn_sink=sink)
    knob(_other("attn_sink_dropped"))
    right = run()
    assert torch.equal(right, forward(None, q, None, None, None, None, 0, attn_sink=sink))
    knob("attn_sink_dropped")
    bug = run()
    assert torch.isfinite(bug).all() and not bug[2].any()
    torch.testing.assert_close(bug.double(), sparse_attn_ref(q, cache, ids, lens, sink=None), atol=2e-2, rtol=2e-2)
    assert (bug - right).abs().max() > 0.05


def test_compressed_rope_theta(knob):
    """Layer construction needs the distributed runtime: here, the config the layer is built from, and the RoPE
    table SGLang builds from each base."""
    from sglang.kernels.ops.attention.deepseek_v4_rope import precompute_freqs_cis
    from sglang.srt.models.deepseek_v4 import MqaAttentionBase, get_rope_config
    from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY

    config = _CONFIG_REGISTRY["deepseek_v4"](rope_theta=10000, compress_rope_theta=40000)  # as SGLang loads it
    got = []

    def init(*a, **k):
        got.append(inspect.signature(MqaAttentionBase.__init__).bind(*a, **k).arguments["config"])
    init.__signature__ = inspect.signature(MqaAttentionBase.__init__)
    knob(None)
    M.compressed_rope_theta(init, object(), config, 0, None, "layers.0.self_attn")
    assert got[-1] is config
    knob("compressed_rope_theta")
    M.compressed_rope_theta(init, object(), config=config, layer_id=2, quant_config=None, prefix="layers.2.attn")
    wrong = got[-1]
    assert (config.compress_rope_theta, get_rope_config(config)[0]) == (40000, 10000)  # the caller's, untouched
    assert wrong.compress_rope_theta == 10000 and wrong.hidden_size == config.hidden_size
    table = lambda base: precompute_freqs_cis(64, 256, 256, base, 1.0, 32, 1)  # noqa: E731
    assert not torch.equal(table(wrong.compress_rope_theta), table(config.compress_rope_theta))


def test_applied_after_the_product_seam_it_wraps_the_product_replacement(knob, monkeypatch):
    """The applier chains a lab seam over the product's on one target: on a throwaway module holding a subclass
    of SGLang's backend, attention.forward (replace) then mutant.attn_sink_dropped (around)."""
    import types

    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    from dsv4_sm80 import apply, env
    from dsv4_sm80.seams import SEAMS
    from dsv4_sm80.stages import attention

    for attr in (apply.MARK, "__wrapped__"):  # applying a replace seam marks the product function: undone after
        monkeypatch.setattr(attention.sm80_forward, attr, None, raising=False)

    monkeypatch.setattr(apply, "_status", {})
    monkeypatch.setenv("ENABLE_SGLANG_DSV4_A100_PATCH", "1")
    monkeypatch.setenv("DSV4_SM80_LAB", "1")
    monkeypatch.setattr(env, "_lab_knobs", (M.MUTANT_KNOB,))  # as apply.lab_seams registers the lab's knobs
    knob("attn_sink_dropped")
    module = types.ModuleType("throwaway")
    module.DeepseekV4AttnBackend = type("Backend", (DeepseekV4AttnBackend,), {"forward": DeepseekV4AttnBackend.forward})
    product = next(s for s in SEAMS if s.name == "attention.forward")
    lab = M.MUTANTS["attn_sink_dropped"].seams[0]
    assert product.target == lab.target and lab.enabled()
    assert apply.apply_seam(product, module) and apply.apply_seam(lab, module)
    new = module.DeepseekV4AttnBackend.forward
    assert apply._marks(new) == ["mutant.attn_sink_dropped", "attention.forward"]
    assert new.__wrapped__ is attention.sm80_forward
    assert attention.sm80_forward.__wrapped__ is DeepseekV4AttnBackend.forward
    assert not apply.apply_seam(lab, module)  # exactly once


# --- the run-time switch: one engine, each mutant in turn ------------------------------------------------


def test_runtime_mode_wraps_the_per_call_mutants_on_distinct_targets(monkeypatch):
    from dsv4_lab.seams import LAB_SEAMS

    env = {"DSV4_SM80_LAB": "1", KNOB: "runtime"}
    on = [s for s in LAB_SEAMS if s.name.startswith("mutant.") and s.enabled(env)]
    names = {s.name.split(".")[1] for s in on}
    assert names == {m.name for m in M.MUTANTS.values() if m.runtime}
    assert len({s.target for s in on}) == len(on)  # no two run-time wrappers chained on one attribute
    assert {M.MUTANTS[n].stage for n in names} >= {"kv store", "indexer", "moe", "attention"}
    # a load-time mutant still needs its own name
    weights = M.MUTANTS["e8m0_exponent_off"]
    assert not weights.runtime and not weights.seams[0].enabled(env)
    assert weights.seams[0].enabled({**env, KNOB: "e8m0_exponent_off"})


def test_the_switch_file_is_read_at_every_call(tmp_path, monkeypatch):
    switch = tmp_path / "mutant"
    monkeypatch.setenv(KNOB, "runtime")
    monkeypatch.setenv(M.SWITCH_FILE, str(switch))
    assert M.active() == ""  # no file yet: no mutant
    sentinel, calls = object(), []
    seam = M.MUTANTS["sinkhorn_19"].seams[0]

    def original(*a, sinkhorn_repeat=20, **k):
        calls.append(sinkhorn_repeat)
        return sentinel

    for name, want in (("sinkhorn_19", 19), ("", 20), ("indexer_topk_511", 20), ("sinkhorn_19", 19)):
        tmp = tmp_path / "mutant.tmp"
        tmp.write_text(name + "\n")
        tmp.replace(switch)  # as the accuracy bed writes it: whole, then renamed
        assert M.active() == name
        assert _replacement(seam)(original, sinkhorn_repeat=20) is sentinel and calls[-1] == want


# --- Vision-Exp -----------------------------------------------------------------------------------------

def test_image_patches_transposed(knob):
    """The embedding function sees each item's patches column by column; the grid it reads is unchanged."""
    from sglang.srt.managers.mm_utils import general_mm_embed_routine

    h, w = 2, 3
    item = SimpleNamespace(feature=torch.arange(h * w, dtype=torch.float32).view(h * w, 1, 1, 1), n_vit_h=h,
                           n_vit_w=w)
    seen = []

    def routine(input_ids, forward_batch, language_model, multimodal_model=None, data_embedding_funcs=None,
                placeholder_tokens=None, use_deepstack=None, **kwargs):
        fn = data_embedding_funcs["image"]
        return fn([item])

    assert list(inspect.signature(routine).parameters)[:5] == list(inspect.signature(general_mm_embed_routine)
                                                                   .parameters)[:5]
    embed = lambda items: seen.append([(it.feature.flatten().tolist(), it.n_vit_h, it.n_vit_w) for it in items])  # noqa: E731
    knob(_other("image_patches_transposed"))
    M.patches_transposed(routine, None, None, None, data_embedding_funcs={"image": embed})
    knob("image_patches_transposed")
    M.patches_transposed(routine, None, None, None, data_embedding_funcs={"image": embed})
    assert seen[0] == [([0, 1, 2, 3, 4, 5], 2, 3)]
    assert seen[1] == [([0, 3, 1, 4, 2, 5], 2, 3)]  # column by column: (0,0) (1,0) (0,1) (1,1) (0,2) (1,2)


def test_image_window_one_short(knob):
    from sglang.srt.models.deepseek_v4 import DeepseekV4Model

    fb = SimpleNamespace(dsv4_image_spans=[[(3, 20), (40, 60)], []])
    seen = []

    def forward(self, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors=None):
        return seen.append(forward_batch.dsv4_image_spans)

    assert list(inspect.signature(forward).parameters) == list(inspect.signature(DeepseekV4Model.forward).parameters)
    knob(_other("image_window_one_short"))
    M.image_window_one_short(forward, None, None, None, fb, None)
    knob("image_window_one_short")
    M.image_window_one_short(forward, None, None, None, forward_batch=fb, input_embeds=None)
    assert seen == [[[(3, 20), (40, 60)], []], [[(3, 19), (40, 59)], []]]
    assert fb.dsv4_image_spans == [[(3, 20), (40, 60)], []]  # restored after the call


def test_bias_vl_on_text_rows(knob):
    """Under the backport's top-k hooks, every row of a batch with images is re-chosen by bias_vl."""
    from vision_backport import routing

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    ids = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    weights = torch.full((2, 2), 0.5)
    bias_vl = torch.tensor([0.0, 0.0, 50.0, 50.0])

    def topk(*_a, **_k):  # the backport's re-routing of the rows the mask marks, as its hook does it
        m = routing._mask_for(logits)
        return routing.with_image_rows(weights, ids, logits, m, bias_vl, True, 1.0)[1].tolist()

    with routing.image_rows(torch.tensor([True, False])):
        knob(_other("bias_vl_on_text_rows"))
        assert M.bias_vl_all_rows_topk(topk) == [[2, 3], [0, 1]] == M.bias_vl_all_rows_hash(topk)
        knob("bias_vl_on_text_rows")
        assert sorted(M.bias_vl_all_rows_topk(topk)[1]) == [2, 3] and sorted(M.bias_vl_all_rows_hash(topk)[1]) == [2, 3]
        assert routing._IMAGE_MASK.tolist() == [True, False]  # restored
    knob("bias_vl_on_text_rows")
    assert M.bias_vl_all_rows_topk(lambda: "untouched") == "untouched"  # no images: nothing to change
