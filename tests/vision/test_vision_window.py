"""The native-path image window (vision.native_window, patch off, for A/B): during SGLang's own
DeepseekV4AttnBackend.forward the metadata's SWA lists are the widened ones (the same lists the SM80
forward uses, checked against a brute force in test_vision_model), restored afterwards; everything else
passes through; an image extend that would take the sparse-prefill branch is refused."""

from types import SimpleNamespace as NS

import pytest
import torch

pytestmark = pytest.mark.sglang


def _setup(rows_override=None, spans=((40, 420),), mode_extend=True):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    g = torch.Generator().manual_seed(1)
    ctx, pool = 1200, 5000
    req_to_token = torch.randperm(pool, generator=g)[:ctx].to(torch.int32)[None]
    full_to_swa = torch.randperm(pool, generator=g).to(torch.int64)
    n = rows_override or 900
    positions = torch.arange(n)
    causal = torch.full((n, 128), 7, dtype=torch.int32)
    lens = torch.clamp(positions + 1, max=128).to(torch.int32)
    core = object.__new__(backend.DSV4AttnMetadata)  # SGLang's own class; only the fields the seam swaps
    core.swa_page_indices, core.swa_topk_lengths = causal, lens
    backend_self = NS(forward_metadata=NS(core_attn_metadata=core), req_to_token=req_to_token,
                      token_to_kv_pool=NS(full_to_swa_index_mapping=full_to_swa))
    fb = NS(dsv4_image_spans=[list(spans)], positions=positions, extend_seq_lens_cpu=[n],
            req_pool_indices=torch.tensor([0]),
            forward_mode=NS(is_extend_without_speculative=lambda: mode_extend))
    return backend_self, fb, core, causal, lens, req_to_token, full_to_swa


def test_lists_widened_during_the_call_and_restored(monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", "0")  # what the bootstrap sets in this mode
    from vision_backport.window import native_forward_with_window, visible_swa_lists

    self_, fb, core, causal, lens, r2t, f2s = _setup()
    seen = {}

    def original(self, q, k, v, layer, forward_batch, compress_ratio, save_kv_cache=True, attn_sink=None, **kw):
        seen.update(ids=self.forward_metadata.core_attn_metadata.swa_page_indices.clone(),
                    lens=self.forward_metadata.core_attn_metadata.swa_topk_lengths.clone(), kw=kw)
        return "o"

    q = torch.zeros(900, 64, 512)
    assert native_forward_with_window(original, self_, q, q, q, None, fb, 4, attn_sink=1, extra=2) == "o"
    want_ids, want_lens = visible_swa_lists(causal, lens, fb.dsv4_image_spans, fb.positions, [900],
                                            fb.req_pool_indices, r2t, f2s)
    assert torch.equal(seen["ids"], want_ids) and torch.equal(seen["lens"], want_lens) and seen["kw"] == {"extra": 2}
    assert seen["ids"].shape == (900, 512) and int(seen["lens"][200]) > 128  # an image query sees further
    assert core.swa_page_indices is causal and core.swa_topk_lengths is lens  # restored


@pytest.mark.parametrize("case", ["no images", "decode"])
def test_other_batches_pass_through(case, monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", "0")
    from vision_backport.window import native_forward_with_window

    self_, fb, core, causal, lens, *_ = _setup(spans=() if case == "no images" else ((40, 420),),
                                               mode_extend=case != "decode")
    seen = []
    native_forward_with_window(lambda s, *a, **k: seen.append(s.forward_metadata.core_attn_metadata.swa_page_indices),
                               self_, torch.zeros(900, 64, 512), None, None, None, fb, 0, attn_sink=1)
    assert seen == [causal]


@pytest.mark.parametrize("why", ["long extend", "knob on"])
def test_sparse_prefill_branch_refused_with_images(why, monkeypatch):
    from sglang.srt.layers.attention import deepseek_v4_backend as backend

    from vision_backport.window import NativeWindowUnsupported, native_forward_with_window

    monkeypatch.setenv("SGLANG_OPT_FLASHMLA_SPARSE_PREFILL", "1" if why == "knob on" else "0")
    n = backend._LARGE_INDEXER_QUERY_THRESHOLD + 1 if why == "long extend" else 900
    self_, fb, *_ = _setup(rows_override=n)
    with pytest.raises(NativeWindowUnsupported, match="chunked-prefill-size 8192"):
        native_forward_with_window(lambda *a, **k: None, self_, torch.zeros(n, 1, 1), None, None, None, fb, 0,
                                   attn_sink=1)


def test_bootstrap_sets_the_prefill_knob_for_native_vision_only():
    """In a fresh interpreter (sitecustomize runs the bootstrap): patch off + vision on sets SGLang's
    sparse-prefill knob to 0 when unset, and leaves a user's value alone."""
    from conftest import last_json, run_python

    code = ("import json, os, sitecustomize\n"
            "print(json.dumps([os.environ.get('SGLANG_OPT_FLASHMLA_SPARSE_PREFILL'), "
            "getattr(sitecustomize, 'DSV4_SM80_STATE', None) is not None]))")
    assert last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="0", DSV4_SM80_VISION="1"))[0] == "0"
    assert last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="0", DSV4_SM80_VISION="1",
                                SGLANG_OPT_FLASHMLA_SPARSE_PREFILL="1"))[0] == "1"
    assert last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="0"))[0] is None  # native: untouched
