"""Request checks SGLang 0.5.16 leaves out, at the tokenizer manager (before anything reaches a GPU).

0.5.16 forwards caller-supplied `input_ids` to the scheduler unchecked: its `_validate_input_ids_in_vocab`
(`tokenizer_manager.py:1129`) exists but nothing calls it. On DSV4 an id outside the vocabulary indexes the
embedding and the hash layers' token table out of range; the device-side assert kills the scheduler and the
server with it (recorded on the H200: one `/generate` with id 10,000,000 took the patched server down).
Here such a request becomes a 400 that names the check instead.
"""

from __future__ import annotations

from array import array
from itertools import chain


def _flat(ids):
    for x in ids:
        if isinstance(x, (list, tuple)):
            yield from x
        else:
            yield x


def check_input_ids(ids, vocab_size: int) -> None:
    """ValueError (SGLang answers 400) unless every caller-supplied id is an int in [0, vocab_size).
    The common case runs in C (array + min/max: about 10 ms for 100K ids, 0.1 ms per 1K, on the tokenizer
    manager's event loop); only a request that fails it is walked id by id for the message."""
    try:
        nested = len(ids) > 0 and isinstance(ids[0], (list, tuple))
        flat = array("q", chain.from_iterable(ids) if nested else ids)  # TypeError: not an int; OverflowError
        if not flat or (min(flat) >= 0 and max(flat) < vocab_size):
            return
    except (TypeError, OverflowError):
        pass
    for pos, tok in enumerate(_flat(ids)):
        if not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise ValueError(
                f"input_ids.range: input_ids[{pos}] is {tok!r}, outside the model's vocabulary [0, {vocab_size}); "
                "send token ids produced by this model's tokenizer (or send text instead)")


def validate_one_request(original, self, obj, input_ids):
    """Around TokenizerManager._validate_one_request: the caller's own `input_ids` (not the ids SGLang built
    for an image request, whose pad values lie past the vocabulary by design) must be in the vocabulary."""
    given = getattr(obj, "input_ids", None)
    if given is not None and not isinstance(given, (str, bytes)):
        check_input_ids(given, int(self.model_config.vocab_size))
    return original(self, obj, input_ids)
