"""Page hygiene (lab): the pool poison of dsv4_lab.hygiene; the GPU run is dsv4_lab/beds/hygiene.py."""


def test_poison_fills_every_pool_buffer_of_target_and_draft(monkeypatch):
    """dsv4_lab.hygiene on pool-shaped objects (the attribute names of sglang 0.5.16's
    DeepSeekV4TokenToKVPool; the seam itself applies in test_seams): every KV row, indexer page and
    state ring is 0xFF afterwards (BF16 NaN), index tensors and other attributes untouched."""
    from types import SimpleNamespace as NS

    import torch

    from dsv4_lab import hygiene

    def pool(with_c4=True):
        return NS(swa_kv_pool=NS(kv_buffer=[torch.zeros(4, 512, dtype=torch.bfloat16) for _ in range(2)]),
                  c4_kv_pool=NS(kv_buffer=[torch.zeros(2, 512, dtype=torch.bfloat16)]) if with_c4 else None,
                  c128_kv_pool=None, unified_kv_pool=None,
                  c4_indexer_kv_pool=(NS(index_k_with_scale_buffer=[torch.zeros(2, 132, dtype=torch.uint8)])
                                      if with_c4 else None),
                  compress_state_pools=[None, NS(kv_score_buffer=NS(kv_score=torch.zeros(3, 8)))],
                  indexer_compress_state_pools=[],
                  full_to_swa_index_mapping=torch.arange(8))
    target, draft = pool(), pool(with_c4=False)
    sched = NS(token_to_kv_pool_allocator=NS(get_kvcache=lambda: target),
               draft_worker=NS(model_runner=NS(token_to_kv_pool=draft)), tp_rank=0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setenv("DSV4_SM80_LAB_POISON", "1")
    assert hygiene.poison_after_flush(False, sched) is None  # not flushed: nothing touched
    assert not target.swa_kv_pool.kv_buffer[0].isnan().any()
    hygiene.poison_after_flush(True, sched)
    for p in (target, draft):
        for name, t in hygiene.kv_buffers(p):
            assert bool((t.view(torch.uint8) == 0xFF).all()), name
    assert len(hygiene.kv_buffers(target)) == 5 and len(hygiene.kv_buffers(draft)) == 3
    assert target.swa_kv_pool.kv_buffer[1].isnan().all()
    assert target.compress_state_pools[1].kv_score_buffer.kv_score.isnan().all()
    assert torch.equal(target.full_to_swa_index_mapping, torch.arange(8))
    monkeypatch.setenv("DSV4_SM80_LAB_POISON", "0")
    fresh = pool()
    sched.token_to_kv_pool_allocator = NS(get_kvcache=lambda: fresh)
    hygiene.poison_after_flush(True, sched)
    assert not fresh.swa_kv_pool.kv_buffer[0].isnan().any()


def _run(rounds):
    """A hygiene child record: rounds of [(ids, in_lp, out_lp)] for prompt lengths 20 and 3000."""
    return {"lengths": [20, 3000], "rounds": [[{"ids": i, "in_lp": a, "out_lp": b} for i, a, b in r] for r in rounds]}


def test_gpu_hygiene_verdict_holds_the_poisoned_run_to_the_clean_floor():
    """dsv4_lab/beds/hygiene.py's comparison: exact where two clean processes are exact, at most twice their own
    difference where they are not, and any NaN fails."""
    import math

    from dsv4_lab.beds import hygiene as H
    clean = _run([[([5, 6], [-1.0, -2.0], [-0.5, -0.6]), ([7, 8], [-1.0, -3.0], [-0.1, -0.2])]])
    clean2 = _run([[([5, 6], [-1.0, -2.0], [-0.5, -0.6]), ([7, 9], [-1.0, -3.1], [-0.1, -0.2])]])
    floor = H.compare(clean, clean2)
    assert floor["cells"][(0, 20)] == {"tokens": 0, "lp": 0.0}
    assert floor["cells"][(0, 3000)]["tokens"] == 1 and abs(floor["cells"][(0, 3000)]["lp"] - 0.1) < 1e-9
    # within twice the floor at 3000 (tokens too: the clean runs differ there), exact at 20: passes
    near = _run([[([5, 6], [-1.0, -2.0], [-0.5, -0.6]), ([7, 4], [-1.0, -3.15], [-0.1, -0.2])]])
    assert H.verdict(floor, H.compare(clean, near), 1e-4)[0]
    # a moved logprob where the clean runs agree exactly fails, as does more than twice the floor
    moved = _run([[([5, 6], [-1.0, -2.001], [-0.5, -0.6]), ([7, 8], [-1.0, -3.0], [-0.1, -0.2])]])
    far = _run([[([5, 6], [-1.0, -2.0], [-0.5, -0.6]), ([7, 8], [-1.0, -3.3], [-0.1, -0.2])]])
    ok, rows = H.verdict(floor, H.compare(clean, moved), 1e-4)
    assert not ok and [r[4] for r in rows] == [False, True]
    assert not H.verdict(floor, H.compare(clean, far), 1e-4)[0]
    # a token change where the clean runs agree exactly fails; a NaN is counted
    retoken = _run([[([5, 1], [-1.0, -2.0], [-0.5, -0.6]), ([7, 8], [-1.0, -3.0], [-0.1, -0.2])]])
    assert not H.verdict(floor, H.compare(clean, retoken), 1e-4)[0]
    nan = _run([[([5, 6], [-1.0, math.nan], [-0.5, -0.6]), ([7, 8], [-1.0, -3.0], [-0.1, -0.2])]])
    assert H.compare(clean, nan)["nonfinite"] == 1
    assert H._jsonable(floor)["cells"][1]["prompt"] == 3000
