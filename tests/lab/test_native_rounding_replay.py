"""DSV4_SM80_LAB_NATIVE_ROUNDING (dsv4_lab/rounding.py, applied as lab seams around the product's stages) against
a float64 reference written from native's key quantization: per 64 values, scale =
2^ceil(log2(max(amax, 1e-4) / 448)), value / scale clamped to +-448 and rounded to the nearest FP8 e4m3 value (ties
to an even mantissa), times the scale; and its activation quantization: per token and 128 columns,
x * (448 / amax) in fp32, clamped, rounded to e4m3, times amax / 448."""

import math

import pytest
import torch

from dsv4_lab import rounding as lab_rounding
from dsv4_sm80 import env


def stacked(sglang_fn, *layers):
    """sglang_fn under the named seams' replacements, in table order, wrapped as the one applier wraps them."""
    from dsv4_lab.seams import LAB_SEAMS
    from dsv4_sm80 import apply
    from dsv4_sm80.seams import SEAMS

    fn = sglang_fn
    for name, replacement in layers:
        fn = apply._wrap(next(s for s in (*SEAMS, *LAB_SEAMS) if s.name == name), fn, replacement)
    return fn


def e4m3_grid():
    """Every finite non-negative e4m3fn value, from its bit fields (bias 7, 3 mantissa bits, max 448)."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return sorted(set(vals))


GRID = e4m3_grid()


@pytest.fixture(autouse=True)
def _fresh_knob():
    """The knob is read once per process: each test starts and ends with it unread, so no value leaks."""
    lab_rounding._items.cache_clear()
    yield
    lab_rounding._items.cache_clear()


def nearest_e4m3(v: float) -> float:
    a = abs(v)
    best = min(GRID, key=lambda g: (abs(g - a), GRID.index(g) % 2))  # tie: the even code (mantissa LSB 0)
    return math.copysign(best, v)


def reference(row):
    out = []
    for t in range(0, len(row), 64):
        tile = [float(x) for x in row[t:t + 64]]
        amax = max(max(abs(x) for x in tile), 1e-4)
        s = 2.0 ** math.ceil(math.log2(amax / 448.0))
        out += [nearest_e4m3(max(-448.0, min(448.0, x / s))) * s for x in tile]
    return out


def test_grid_is_e4m3fn():
    assert len(GRID) == 127 and GRID[-1] == 448.0 and GRID[1] == 2.0 ** -9


def test_tiles_match_the_float64_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 448, generator=g) * torch.tensor([1e-3, 0.05, 1.0, 7.0, 300.0, 1e4])[:, None]
    x[0, :64] = 0.0  # an all-zero tile
    x[1, 64] = 1e-7  # a tiny value beside larger ones (underflows to 0 or a subnormal)
    x = x.to(torch.bfloat16)
    got = lab_rounding.fp8_pow2_tiles(x)
    assert got.dtype == torch.bfloat16
    for r in range(x.shape[0]):
        want = torch.tensor(reference(x[r].double().tolist()), dtype=torch.float64)
        assert torch.equal(got[r].double(), want), r  # exact: e4m3 times a power of two is a BF16 value


def test_rounding_is_idempotent_and_leaves_other_rows_and_the_rope_part():
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(10, 512, generator=g).to(torch.bfloat16)
    before = cache.clone()
    lab_rounding.kv_rows_(cache, torch.tensor([3, -1, 7]))
    changed = [r for r in range(10) if not torch.equal(cache[r], before[r])]
    assert changed == [3, 7]
    assert torch.equal(cache[:, 448:], before[:, 448:])
    once = cache.clone()
    lab_rounding.kv_rows_(cache, torch.tensor([3, 7]))
    assert torch.equal(cache, once)


def test_knob_values(monkeypatch):
    monkeypatch.delenv("DSV4_SM80_LAB_NATIVE_ROUNDING", raising=False)
    lab_rounding._items.cache_clear()
    assert not lab_rounding.kv_enabled()
    monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", "kv")
    lab_rounding._items.cache_clear()
    assert lab_rounding.kv_enabled()
    assert not lab_rounding.act_enabled()
    monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", "kv,act")
    lab_rounding._items.cache_clear()
    assert lab_rounding.kv_enabled() and lab_rounding.act_enabled()
    monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", "act,kv")  # the documented order only
    lab_rounding._items.cache_clear()
    with pytest.raises(env.EnvError, match="not one of 0, kv, act, gemm, idx, kv,act"):
        lab_rounding.kv_enabled()


def test_hooks_round_what_the_sm80_pool_stores(monkeypatch):
    """The SWA store (norm + rope + BF16 store kernel, here in Triton's interpreter on the CPU) and the plain
    row store: with the knob, the stored rows are the knob-off rows rounded; without it, untouched."""
    from types import SimpleNamespace as NS

    from conftest import dev
    from dsv4_sm80.stages import attention

    g = torch.Generator().manual_seed(2)
    n = 5
    kv = torch.randn(n, 512, generator=g).to(torch.bfloat16)
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    theta = torch.rand(64, 32, generator=g) * 6.28
    f = torch.polar(torch.ones_like(theta), theta)
    pos = torch.randint(0, 64, (n,), generator=g)
    loc = torch.tensor([4, -1, 0, 9, 2], dtype=torch.int64)

    def swa_store(knob):
        monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", knob)
        lab_rounding._items.cache_clear()
        pool = NS(swa_kv_pool=NS(kv_buffer=[dev(torch.zeros(2, 8 * 512, dtype=torch.bfloat16))]),
                  _swa_local_layer_id=lambda layer: layer)
        lab_rounding.swa_norm_rope_store(attention.bf16_swa_norm_rope_store, pool, 0, *dev(loc, kv, w), 1e-6,
                                         *dev(f, pos))
        return pool.swa_kv_pool.kv_buffer[0].view(-1, 512).cpu()

    def row_store(knob):
        monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", knob)
        lab_rounding._items.cache_clear()
        pool = NS(kv_buffer=[dev(torch.zeros(16, 512, dtype=torch.bfloat16))], qk_nope_head_dim=448,
                  qk_rope_head_dim=64)
        lab_rounding.set_key_buffer(attention.bf16_set_key_buffer_fused, pool, 0, *dev(loc, kv))
        return pool.kv_buffer[0].cpu()

    written = loc[loc >= 0]
    for store in (swa_store, row_store):
        off, on = store("0"), store("kv")
        assert not torch.equal(on[written], off[written])
        others = [s for s in range(on.shape[0]) if s not in written.tolist()]
        assert torch.equal(on[others], off[others]), store.__name__
    # the plain row store: the knob-off rows, their nope part rounded
    off, on = row_store("0"), row_store("kv")
    assert torch.equal(on[written], torch.cat([lab_rounding.fp8_pow2_tiles(off[written][:, :448]),
                                               off[written][:, 448:]], dim=1))
    # the SWA store: native quantizes the fp32 normed row, not its BF16 rounding (float64 reference; fp32 against
    # float64 may land one value on the other side of a rounding boundary, hence "at most one step, rarely")
    from dsv4_sm80.kernels.kv_store_ref import k_norm_rope_ref

    on = swa_store("kv")
    close_steps(on[written], native_swa_rows(k_norm_rope_ref(kv, w, 1e-6, f, pos)[loc >= 0]))


def native_swa_rows(exact):
    """Native's SWA cache rows from float64 normed and roped rows: the nope part quantized from them (through
    fp32, as native's store holds them), the rope part rounded to BF16."""
    return torch.cat([lab_rounding.fp8_pow2_tiles(exact[:, :448].float()), exact[:, 448:].float()],
                     dim=1).to(torch.bfloat16)


def close_steps(got, want, rare=2):
    """got equals want except at most `rare` values, each one representable step (FP8 on the nope part, BF16
    on the rope part, both read as the BF16 spacing times 16 at most) away."""
    diff = got.double() - want.double()
    bad = diff != 0
    assert int(bad.sum()) <= rare, int(bad.sum())
    if bad.any():
        assert (diff[bad].abs() <= want.double().abs()[bad] * 2 ** -3 + 1e-30).all()


def test_swa_rows_quantize_from_fp32_not_from_bf16():
    """lab_rounding.swa_rows against the float64 reference, on enough values to see the double rounding it
    avoids: the nope part quantized from its BF16 rounding differs in about 1 value in 32 (a BF16 value on an
    e4m3 midpoint), by one FP8 step each."""
    from dsv4_sm80.kernels.kv_store_ref import k_norm_rope_ref

    g = torch.Generator().manual_seed(6)
    n = 64
    kv = (torch.randn(n, 512, generator=g) * torch.rand(n, 1, generator=g) * 4).to(torch.bfloat16)
    w = (torch.rand(512, generator=g) + 0.5).to(torch.bfloat16)
    theta = torch.rand(128, 32, generator=g) * 6.28
    f = torch.polar(torch.ones_like(theta), theta)
    pos = torch.randint(0, 128, (n,), generator=g)
    got = lab_rounding.swa_rows(kv, w, 1e-6, f, pos)
    assert got.dtype == torch.bfloat16 and got.shape == (n, 512)
    exact = k_norm_rope_ref(kv, w, 1e-6, f, pos)
    close_steps(got, native_swa_rows(exact), rare=4)
    assert torch.equal(lab_rounding.swa_rows(kv, w, 1e-6, torch.view_as_real(f), pos), got)  # the fp32 table
    twice = lab_rounding.fp8_pow2_tiles(exact[:, :448].to(torch.bfloat16))
    share = (twice != got[:, :448]).double().mean().item()
    assert 0.01 < share < 0.06, share


def act_reference(row):
    """Native's per_token_group_quant (fp32 arithmetic, as its kernel does it) and dequantization, per 128."""
    import numpy as np

    out = []
    for t in range(0, len(row), 128):
        g = np.asarray(row[t:t + 128], dtype=np.float32)
        amax = np.float32(max(float(np.abs(g).max()), 1e-10))
        scaled = g * (np.float32(448.0) / amax)
        q = [nearest_e4m3(max(-448.0, min(448.0, float(v)))) for v in scaled]
        out += [float(np.float32(v) * (amax * (np.float32(1.0) / np.float32(448.0)))) for v in q]
    return out


def test_activation_rounding_matches_the_reference():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 384, generator=g) * torch.tensor([1e-3, 0.3, 5.0, 80.0])[:, None]).to(torch.bfloat16)
    x[0, :128] = 0.0
    got = lab_rounding.fp8_act(x)
    assert got.dtype == torch.float32
    for r in range(x.shape[0]):
        assert got[r].tolist() == act_reference(x[r].float().tolist()), r


def test_activation_rounding_linear_and_the_bf16_method(monkeypatch):
    """fp8_act_linear is the fp32 product of the rounded activation and the weight; the lab seam makes the
    product's BF16 linear method take it with act on, and leaves the method plain F.linear otherwise."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; the method class subclasses SGLang's")
    from types import SimpleNamespace as NS

    from dsv4_sm80.stages.dense import _method_class

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    w = (torch.randn(64, 256, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(64, generator=g).to(torch.bfloat16)
    want = (lab_rounding.fp8_act(x).double() @ w.double().t() + b.double()).to(torch.bfloat16)
    got = lab_rounding.fp8_act_linear(x, w, b)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want.double()).abs().max() <= 2 ** -7 * want.double().abs().max()
    plain = torch.nn.functional.linear(x, w, b)
    assert not torch.equal(got, plain)
    cls = _method_class()

    def method_for(knob):
        monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", knob)
        lab_rounding._items.cache_clear()
        return lab_rounding.linear_method(lambda *a: cls.__new__(cls), None, None, "t")

    assert torch.equal(method_for("act").apply(NS(weight=w), x, b), got)
    assert torch.equal(method_for("0").apply(NS(weight=w), x, b), plain)
    assert "apply" not in vars(method_for("kv"))  # the class's own method: nothing replayed
    with pytest.raises(ValueError, match="not a multiple of 128"):
        lab_rounding.fp8_act_linear(x[:, :200], w[:, :200])


def test_gemm_keeps_the_fp8_weight_and_runs_natives_block_linear_on_it(monkeypatch):
    """DSV4_SM80_LAB_NATIVE_ROUNDING=gemm: the lab's seam on the quant method makes the BF16 method keep the
    loaded FP8 weight and scale beside the BF16 weight and send the input, unrounded, to the FP8 block linear
    SGLang's Fp8LinearMethod dispatched to (DeepGEMM's on an SM90 GPU; the H200 run is where it computes: here a
    recording stand-in for that one function attribute checks the wiring)."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; the method class subclasses SGLang's")
    from dsv4_sm80.stages.dense import _method_class

    monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", "kv,gemm,idx")
    lab_rounding._items.cache_clear()
    assert lab_rounding.gemm_enabled() and not lab_rounding.act_enabled()
    cls = _method_class()

    def product(*args):
        method = cls.__new__(cls)  # Fp8LinearMethod.__init__ dispatches on the platform; its result is set below
        method.prefix, method.weight_block_size = "t", [128, 128]
        return method

    method = lab_rounding.linear_method(product, None, None, "t")
    g = torch.Generator().manual_seed(8)
    w8 = (torch.randn(256, 128, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0 ** -8], [2.0 ** -5]])
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w8, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.bfloat16 and not hasattr(layer, "weight_scale_inv")  # the product's load
    kept_w, kept_s = layer.lab_fp8  # the loaded tensors themselves (same storage), not copies
    assert kept_w.data_ptr() == w8.data_ptr() and kept_s.data_ptr() == s.data_ptr()
    calls = []
    method.w8a8_block_fp8_linear = lambda **kw: calls.append(kw) or "native"
    x, b = torch.randn(3, 128, generator=g).to(torch.bfloat16), torch.zeros(256, dtype=torch.bfloat16)
    assert method.apply(layer, x, b) == "native"
    (kw,) = calls
    assert kw["input"] is x and kw["weight"] is kept_w and kw["weight_scale"] is kept_s and kw["bias"] is b
    assert kw["block_size"] == [128, 128] and kw["input_scale"] is None


def test_fp8_paged_logits_against_the_float64_reference(monkeypatch):
    """The idx replay's logits over an FP8 index cache (pages of 64 x (128 e4m3 + fp32 scale)), token by
    token in float64: s_k[j] * sum_h w[t,h] * ReLU(q[t,h] . k[j]) for j < seq_len[t], 0 beyond."""
    g = torch.Generator().manual_seed(5)
    n_pages, heads, t_total, max_len = 7, 4, 9, 300
    vals = (torch.randn(n_pages, 64, 128, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(n_pages, 64, generator=g) * 0.01 + 1e-3
    cache = torch.cat([vals.view(torch.uint8).reshape(n_pages, -1),
                       scales.contiguous().view(torch.uint8).reshape(n_pages, -1)], dim=1)  # [pages, 64 * 132]
    q = (torch.randn(t_total, 1, heads, 128, generator=g) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = torch.randn(t_total, heads, generator=g)
    lens = torch.tensor([0, 1, 63, 64, 65, 200, 256, 130, 7])
    table = torch.stack([torch.randperm(n_pages, generator=g)[:5] for _ in range(t_total)]).to(torch.int32)
    table[2, 1:] = -1  # unused entries past a token's pages
    got = lab_rounding.fp8_paged_logits(q, cache.view(n_pages, 64, 1, 132), w, lens.unsqueeze(-1), table, max_len,
                                        chunk=4)
    assert got.shape == (t_total, max_len) and got.dtype == torch.float32
    for t in range(t_total):
        want = torch.zeros(max_len, dtype=torch.float64)
        for j in range(int(lens[t])):
            page, off = int(table[t, j // 64]), j % 64
            k = vals[page, off].double()
            dots = q[t, 0].double() @ k
            want[j] = float(scales[page, off]) * float((torch.relu(dots) * w[t].double()).sum())
        assert torch.allclose(got[t].double(), want, rtol=1e-5, atol=1e-6), t


def test_idx_replay_routes_the_indexer_to_sglangs_fp8_kernels(monkeypatch):
    """With idx the query and the index store are SGLang's own (the function under the product's seam), the main
    (512-wide) store stays the BF16 one; without it the product's INT8 path runs and SGLang's are not called."""
    from dsv4_sm80.stages import attention

    calls = []

    def sglang_fn(*args, **kwargs):
        calls.append(kwargs if kwargs else args)
        return "native"

    query = stacked(sglang_fn, ("attention.indexer_q", attention.indexer_q_int8),
                    ("lab.rounding.indexer_q", lab_rounding.indexer_q))
    store = stacked(sglang_fn, ("attention.compress_store", attention.compress_store),
                    ("lab.rounding.compress_store", lab_rounding.compress_store))
    monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", "idx")
    lab_rounding._items.cache_clear()
    assert query("q", "w", 0.5, "f", "p") == "native" and calls[-1] == ("q", "w", 0.5, "f", "p")
    kv = torch.zeros(3, 128)
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    assert store(kv, "plan", norm_weight="nw", norm_eps=1e-6, freq_cis="fc", out_loc="ol", kvcache=cache,
                 page_size=64) == "native"
    assert calls[-1]["bf16_store"] is False and calls[-1]["use_fp4"] is False and calls[-1]["kvcache"] is cache
    assert calls[-1]["page_size"] == 64
    monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", "0")
    lab_rounding._items.cache_clear()
    n = len(calls)
    with pytest.raises(ValueError):  # the INT8 kernel rejects the stand-in arguments: the point is it ran
        query(torch.zeros(2, 3), "w", 0.5, "f", "p")
    assert len(calls) == n


def test_the_act_replay_takes_sglangs_quantizer_on_a_gpu_and_the_model_elsewhere():
    """On the H200 (2026-12-01, `steps.sh trace-linears` at 8ce119d) native's FP8 linear is 2-3e-3 (relative) from the
    model `fp8_act` on every linear but 7-9e-4 from SGLang's own quantizer followed by the exact product, so on a GPU
    the replay quantizes with SGLang's (real, imported here); a CPU tensor keeps the model written from the math."""
    quant = lab_rounding.sglang_act_quantizer()
    assert quant is not None and quant.__name__ == "sglang_per_token_group_quant_fp8"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert torch.equal(lab_rounding.native_act(x), lab_rounding.fp8_act(x))


def test_gemm_sends_the_mhc_prenorm_gemm_to_deepgemm(monkeypatch):
    """With gemm the mHC seam defers to DeepGEMM's own tf32_hc_prenorm_gemm, with upstream's arguments (zero
    rows: nothing to do, as upstream). DeepGEMM needs an SM90 GPU, so here a recorder stands in for that one
    function of the real deep_gemm module, and the SM80 Triton GEMM must not run."""
    deep_gemm = pytest.importorskip("deep_gemm", reason="SGLang's DeepGEMM package")
    from dsv4_sm80.kernels import hc_prenorm
    from dsv4_sm80.stages import mhc

    monkeypatch.setenv("DSV4_SM80_LAB_NATIVE_ROUNDING", "gemm")
    lab_rounding._items.cache_clear()
    calls = []
    monkeypatch.setattr(deep_gemm, "tf32_hc_prenorm_gemm", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(hc_prenorm, "hc_prenorm", lambda *a, **kw: pytest.fail("the SM80 GEMM ran"))

    def gemm(*args):  # the lab's seam around the product's replacement
        return lab_rounding.hc_prenorm_gemm(mhc.hc_prenorm_gemm, *args)

    gemm(torch.zeros(0, 256), torch.zeros(24, 256), torch.empty(0, 24), torch.empty(0), None)
    assert calls == []
    x, fn, out, sq = torch.ones(2, 256), torch.ones(24, 256), torch.empty(2, 24), torch.empty(2)
    gemm(x, fn, out, sq, 3)
    ((args, kw),) = calls
    assert all(a is b for a, b in zip(args, (x, fn, out, sq))) and kw == {"num_splits": 3}
