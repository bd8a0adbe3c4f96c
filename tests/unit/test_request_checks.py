"""Request checks at SGLang's tokenizer manager (dsv4_sm80/stages/requests.py): caller-supplied token ids outside
the vocabulary are a 400 naming input_ids.range, not a device-side assert that takes the server down."""

import pytest

from conftest import last_json, run_python
from dsv4_sm80.stages.requests import check_input_ids


def test_ids_inside_the_vocabulary_pass():
    check_input_ids([0, 5, 999], 1000)
    check_input_ids([[0, 1], [2, 999]], 1000)  # a batch
    check_input_ids([], 1000)
    check_input_ids(list(range(1000)) * 100, 1000)  # 100K ids: the C path


@pytest.mark.parametrize("ids, bad", [([0, 10_000_000], "10000000"), ([0, -5], "-5"), ([1000], "1000"),
                                      ([0, 2.5], "2.5"), ([0, 2 ** 70], str(2 ** 70)), ([[0], [1, 1000]], "1000")])
def test_ids_outside_are_refused_naming_the_check(ids, bad):
    with pytest.raises(ValueError) as e:
        check_input_ids(ids, 1000)
    msg = str(e.value)
    assert msg.startswith("input_ids.range: input_ids[") and f"is {bad}" in msg and "[0, 1000)" in msg


TOKENIZER_MANAGER = r"""
import json, types
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.io_struct import GenerateReqInput

tm = object.__new__(TokenizerManager)  # the real class; only the attributes its check reads are set
tm.model_config = types.SimpleNamespace(vocab_size=1000)
tm.context_len, tm.num_reserved_tokens, tm.allow_auto_truncate = 4096, 0, False
tm.validate_total_tokens, tm.is_generation = True, True
tm.server_args = types.SimpleNamespace(enable_return_hidden_states=False, enable_custom_logit_processor=False)
out = {}
for name, ids in (("good", [0, 1, 999]), ("beyond", [0, 10_000_000]), ("negative", [0, -5])):
    obj = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 4})
    try:
        tm._validate_one_request(obj, list(ids))
        out[name] = "ok"
    except ValueError as e:
        out[name] = str(e)
# an image request: SGLang's expanded ids carry pad values past the vocabulary; the caller sent text
obj = GenerateReqInput(text="x", sampling_params={"max_new_tokens": 4})
tm._validate_one_request(obj, [0, 5_000_000_000, 1])
out["image_pads"] = "ok"
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_seam_answers_out_of_vocabulary_ids_at_sglangs_tokenizer_manager():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; the seam test needs the real one")
    on = last_json(run_python(TOKENIZER_MANAGER, ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    assert on["good"] == "ok" and on["image_pads"] == "ok", on
    assert on["beyond"].startswith("input_ids.range: input_ids[1] is 10000000"), on
    assert on["negative"].startswith("input_ids.range: input_ids[1] is -5"), on
    off = last_json(run_python(TOKENIZER_MANAGER, ENABLE_SGLANG_DSV4_A100_PATCH="0"))
    assert off == {"good": "ok", "beyond": "ok", "negative": "ok", "image_pads": "ok"}  # 0.5.16 lets them through
