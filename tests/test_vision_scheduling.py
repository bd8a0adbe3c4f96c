"""Image blocks stay whole across prefill chunks: the cut rule against a brute force, and the seam on
SGLang 0.5.16's own Req (fresh interpreter, patch and vision on), cut by cut as chunked prefill makes them."""

import random

import pytest

from conftest import last_json, run_python
from vision_backport.scheduling import whole_block_end


def splits_a_block(end, full_len, spans):
    return end < full_len and any(s < end <= e for s, e in spans)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_cut_rule_against_brute_force(page):
    """Against every possible cut: SGLang's own cut when it splits no block; else the last allowed cut before
    it, else the first after it, where an allowed cut is past the chunk's start, splits no block and is a
    page edge (or the prompt's end)."""
    rng = random.Random(page)
    for _ in range(3000):
        full_len = rng.randint(2, 160)
        spans, pos = [], rng.randint(0, 10)
        while pos < full_len - 1 and rng.random() < 0.8:
            s = pos + rng.randint(0, 12)
            e = s + rng.randint(0, 25)
            if e >= full_len:
                break
            spans.append((s, e))
            pos = e + 1
        start = rng.randint(0, full_len - 1) // page * page
        end = min(full_len, start + rng.randint(1, 40) * page)  # SGLang's cuts: page edges or the end
        if start >= full_len or any(s < start <= e for s, e in spans):
            continue  # a prefix ending inside a block: never produced (the cuts keep them at edges)
        r = whole_block_end(start, end, full_len, spans, page)
        allowed = [p for p in range(start + 1, full_len + 1)
                   if (p % page == 0 or p == full_len) and not splits_a_block(p, full_len, spans)]
        if not splits_a_block(end, full_len, spans):
            assert r == end
        else:
            before = [p for p in allowed if p < end]
            assert r == (before[-1] if before else min(p for p in allowed if p > end)), (start, end, spans, r)
        assert r > start and (r % page == 0 or r == full_len)
        assert not splits_a_block(r, full_len, spans)


CHUNKING = r"""
import json
from array import array
if CKPT:  # the server's args, as the scheduler has them (DSV4 sets its KV page size: 256)
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    set_global_server_args_for_scheduler(ServerArgs(model_path=CKPT, device="cpu", skip_tokenizer_init=True))
    from sglang.srt.server_args import get_global_server_args
    page = get_global_server_args().page_size
else:
    page = 1
from sglang.srt.managers.schedule_batch import MultimodalDataItem, MultimodalInputs, Modality, Req
from sglang.srt.sampling.sampling_params import SamplingParams
n = 1000
req = Req("r", "", array("i", [7] * n), SamplingParams(max_new_tokens=4))
req.full_untruncated_fill_ids = req.origin_input_ids
blocks = [(100, 399), (420, 430), (600, 999 - 3)]
items = [MultimodalDataItem(modality=Modality.IMAGE, offsets=[b], model_specific_data={"types": [0]}) for b in blocks]
req.multimodal_inputs = MultimodalInputs(mm_items=items)
cuts, prefix = [], 0
while prefix < n and len(cuts) < 100:
    req.set_extend_range(prefix, min(prefix + CHUNK, n))  # what PrefillAdder.add_chunked_req asks for
    cuts.append([req.extend_range.start, req.extend_range.end])
    prefix = req.extend_range.end
text = Req("t", "", array("i", [7] * n), SamplingParams(max_new_tokens=4))
text.full_untruncated_fill_ids = text.origin_input_ids
text.set_extend_range(0, 150)
print(json.dumps({"cuts": cuts, "text": [text.extend_range.start, text.extend_range.end], "page": page}))
"""


@pytest.mark.sglang
@pytest.mark.parametrize("chunk, with_args", [(128, False), (256, True), (512, True)])
def test_sglang_req_chunks_keep_blocks_whole(chunk, with_args, unit_ckpt):
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    code = CHUNKING.replace("CHUNK", str(chunk)).replace("CKPT", repr(unit_ckpt) if with_args else "None")
    on = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_VISION="1"))
    assert on["page"] == (256 if with_args else 1)
    blocks = [(100, 399), (420, 430), (600, 996)]
    ends = [e for _, e in on["cuts"]]
    assert ends[-1] == 1000 and all(b > a for a, b in on["cuts"])  # progress, to the end
    assert not any(s < c <= e for c in ends[:-1] for s, e in blocks), on["cuts"]
    assert all(c % on["page"] == 0 for c in ends[:-1]), on["cuts"]  # page edges, as SGLang's own cuts
    assert on["text"] == [0, 150]  # a request without images: SGLang's cut as it was
    off = last_json(run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", DSV4_SM80_VISION="0"))
    assert [c for _, c in off["cuts"]] == list(range(chunk, 1000, chunk)) + [1000]  # the native cuts
