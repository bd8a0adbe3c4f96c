"""A stand-in tokenizer for tiny checkpoints, so SGLang's HTTP path (`/generate`, `/v1/chat/completions`)
runs end to end on them. The real DeepSeek-V4 tokenizer is not redistributable here (and not reachable
offline); this one has what the serving path needs, not its merges:

- exactly `vocab_size` ids, so every id a random-weight model can emit decodes;
- DSV4's chat-encoding special tokens (SGLang's `encoding_dsv4`: BOS `<｜begin▁of▁sentence｜>` = 0 and EOS
  `<｜end▁of▁sentence｜>` = 1 as in config.json, `<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`, ...),
  the five reserved ids 129257-129261 the Vision-Exp processor borrows for image sentinels, and its image
  placeholder `<｜deepseek_image｜>` at 129264;
- byte-level encoding of any text (256 byte tokens, no merges): text round-trips exactly;
- every other id is a filler that decodes to " w<id>".
"""

from __future__ import annotations

import json
import os

SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
            "<｜latest_reminder｜>", "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>",
            "<｜read_url｜>", "<｜▁pad▁｜>")
VISION_IDS = {129257 + i: f"<|place_holder_mm_span_{431 + i:04d}|>" for i in range(5)}
VISION_IDS[129264] = "<｜deepseek_image｜>"  # the Vision-Exp image placeholder


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet), by byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tokenizer(out_dir: str, vocab_size: int) -> dict:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json for a checkpoint of vocab_size ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = {i: t for i, t in enumerate(SPECIALS)}
    specials.update({i: t for i, t in VISION_IDS.items() if i < vocab_size})
    alphabet = _byte_alphabet()
    if vocab_size < len(SPECIALS) + len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} < {len(SPECIALS) + len(alphabet)} (specials + 256 bytes)")
    vocab, next_id = {}, 0
    for i in range(vocab_size):
        if i in specials:
            vocab[specials[i]] = i
        elif next_id < len(alphabet):
            vocab[alphabet[next_id]] = i
            next_id += 1
        else:
            vocab[f"Ġw{i}"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size(with_added_tokens=True)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
              "pad_token": SPECIALS[-1], "add_bos_token": False, "add_eos_token": False,
              "model_max_length": 1048576, "clean_up_tokenization_spaces": False, "legacy": False}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[-1]}, f,
                  indent=2, ensure_ascii=False)
    return {"vocab_size": vocab_size, "specials": len(specials)}
