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


UNCHUNK = r"""
import json
from array import array
from types import SimpleNamespace
from sglang.srt.managers.schedule_batch import MultimodalDataItem, MultimodalInputs, Modality, Req
from sglang.srt.sampling.sampling_params import SamplingParams
from vision_backport.scheduling import add_chunked_req_unchunked_when_whole, add_req_unchunked_when_whole
from sglang.srt.server_args import ServerArgs, get_global_server_args, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(model_path=CKPT, device="cpu", skip_tokenizer_init=True))
assert get_global_server_args().page_size == 256  # DSV4's KV page: the rule's cuts are page edges

def req_with_block(n, block):
    req = Req("r", "", array("i", [7] * n), SamplingParams(max_new_tokens=4))
    req.full_untruncated_fill_ids = req.origin_input_ids
    item = MultimodalDataItem(modality=Modality.IMAGE, offsets=[block], model_specific_data={"types": [0]})
    req.multimodal_inputs = MultimodalInputs(mm_items=[item])
    return req

def sglang_chunked_branch(adder, req, has_chunked_req, truncation_align_size):
    # what PrefillAdder.add_one_req does when the prompt is longer than the chunk (schedule_policy.py:1167-1174)
    req.set_extend_range(0, 256)
    adder.new_chunked_req = req

def sglang_later_chunk(adder, req):
    # PrefillAdder.add_chunked_req with SGLang's own cut short of the end (schedule_policy.py:848-870)
    start = int(req.extend_range.end)
    req.set_extend_range(start, start + 256)
    return req

out = {}
for name, n, block in (("moved_to_end", 300, (200, 290)), ("moved_not_to_end", 900, (200, 290)),
                       ("not_moved", 900, (10, 20))):
    req, adder = req_with_block(n, block), SimpleNamespace(new_chunked_req=None)
    add_req_unchunked_when_whole(sglang_chunked_branch, adder, req, False, None)
    out[name] = [req.extend_range.end, adder.new_chunked_req is req]
req = req_with_block(700, (500, 690))
req.set_extend_range(0, 256)
out["later_moved_to_end"] = [add_chunked_req_unchunked_when_whole(sglang_later_chunk, SimpleNamespace(), req) is req,
                             req.extend_range.end]
req = req_with_block(1200, (500, 690))
req.set_extend_range(0, 256)
out["later_short"] = [add_chunked_req_unchunked_when_whole(sglang_later_chunk, SimpleNamespace(), req) is req,
                      req.extend_range.end]
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_a_chunk_moved_to_the_prompt_end_is_not_chunked_any_more(unit_ckpt):
    """On the H200 (2026-12-01, --chunked-prefill-size 256) an image block across SGLang's 256-token cut moved the cut
    to the prompt's end, but SGLang had already flagged the request chunked and scheduled an empty extend next round
    (its compressor plan refused it: c_plan.cuh:507). The wrappers around PrefillAdder's admission clear the flag
    exactly when the moved cut reached the prompt's end, on SGLang's real Req with the whole-block seam applied."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    got = last_json(run_python(UNCHUNK.replace("CKPT", repr(unit_ckpt)), ENABLE_SGLANG_DSV4_A100_PATCH="1",
                               DSV4_SM80_VISION="1"))
    assert got["moved_to_end"] == [300, False]  # block [200, 290] across 256, prompt 300: whole, not chunked
    assert got["moved_not_to_end"] == [512, True]  # moved to the next page edge past the block: still chunked
    assert got["not_moved"] == [256, True]  # SGLang's own cut: still chunked
    assert got["later_moved_to_end"] == [False, 700]  # the last chunk, whatever SGLang's cut said
    assert got["later_short"] == [True, 768]
