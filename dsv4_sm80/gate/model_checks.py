"""The gate's checkpoint checks: what SGLang's loader relies on, judged as data before anything starts.

config.json with the release's types and the values this datapath runs; the index naming shard files
inside the model folder; every shard's safetensors header as strict as the safetensors library (known
dtypes, non-negative shapes, contiguous in-bounds non-overlapping offsets, byte size = numel x dtype
size); every tensor exactly once; the native key inventory (`checkpoint.format`); the tokenizer files.
"""

from __future__ import annotations

import math
import os

from ..checkpoint import format as fmt
from .facts import (
    CONFIG,
    INDEX,
    OPTIONAL_TOKENIZER_FILES,
    TOKENIZER_FILES,
    FileFact,
    HeaderFact,
    JsonFact,
    ModelFacts,
    index_name_problem,
)
from .inventory import compare_inventory
from .report import OFFICIAL, fail, ok, skip

# The safetensors library's dtypes and their element sizes (the official checkpoint uses six of them).
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                      "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}

RELEASE = {**fmt.flash_0731_config(), **fmt.VISION_EXP_FIELDS}
# the fields `checkpoint.format.inventory` and SGLang's model build read: without them nothing loads
REQUIRED = ("architectures", "model_type", "torch_dtype", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts",
            "num_experts_per_tok", "vocab_size", "hc_mult", "index_n_heads", "index_head_dim", "num_hash_layers",
            "compress_ratios")
# release numbers that are real-valued: an integer is as good as a float there
REAL = {"rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit", "hc_eps", "rms_norm_eps",
        "initializer_range", "attention_dropout", "vision_rope_theta", "rope_scaling.factor",
        "rope_scaling.beta_fast", "rope_scaling.beta_slow"}
# values the SM80 datapath has only ever run as released: kernels and shapes are built around them
FIXED = ("torch_dtype", "head_dim", "qk_rope_head_dim", "index_head_dim", "index_n_heads", "index_topk", "hc_mult",
         "num_key_value_heads", "expert_dtype", "hidden_act", "scoring_func", "topk_method", "n_shared_experts",
         "num_experts_per_tok", "sliding_window", "attention_bias", "tie_word_embeddings")
# the inventory walks layers and experts one by one: bounds far above any DSV4 release keep that finite
AT_MOST = {"num_hidden_layers": 1024, "n_routed_experts": 4096, "vision_n_layers": 1024}
WIDEST = 1 << 24  # any width or count above this is no DSV4 checkpoint
POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "o_lora_rank", "o_groups",
            "moe_intermediate_size", "n_routed_experts", "vocab_size", "dspark_markov_rank", *fmt.VISION_EXP_FIELDS)


# --- files ------------------------------------------------------------------------------------------

def file_problem(f: FileFact, folder: str) -> tuple[str, str] | None:
    """(what stands there, the fix for that cause), or None for a readable regular file."""
    path = os.path.join(folder, f.name)
    if f.kind == "file":
        return None
    if f.kind == "missing":
        return "missing", f"put the release's {f.name} back (re-download it)"
    if f.kind == "directory":
        return "a directory, not a file", f"remove the directory {path} and put the release's file there"
    if f.kind == "special":
        return f"{f.detail}, not a regular file", f"replace {path} with the release's regular file"
    if f.kind == "denied":
        return (f"not readable ({f.detail})", f"make it readable by the user that runs the server: chmod a+r {path} "
                "(and a+x on the folders above it), or chown it to that user")
    return f"unreadable ({f.detail})", f"the disk reported an error reading {path}: check the filesystem, copy it again"


def json_problem(j: JsonFact, folder: str, restore: str) -> tuple[str, str] | None:
    bad = file_problem(j.file, folder)
    if bad:
        return f"{j.file.name}: {bad[0]}", bad[1]
    if j.error:
        return f"{j.file.name} is {j.error}", restore
    if not isinstance(j.value, dict):
        return f"{j.file.name} holds {_type_name(j.value)} at the top, not an object", restore
    return None


def _type_name(v) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


# --- config.json ------------------------------------------------------------------------------------

def type_problem(key: str, want, got) -> str | None:
    """The first place where `got` does not have the release value `want`'s JSON type."""
    if isinstance(want, bool):
        good = isinstance(got, bool)
    elif isinstance(want, (int, float)) and (isinstance(want, float) or key in REAL):
        good = isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got)
    elif isinstance(want, int):
        good = isinstance(got, int) and not isinstance(got, bool)
    elif isinstance(want, str):
        good = isinstance(got, str)
    elif isinstance(want, list):
        if not isinstance(got, list):
            good = False
        else:
            for i, g in enumerate(got):
                if want and (p := type_problem(f"{key}[{i}]", want[0], g)):
                    return p
            return None
    elif isinstance(want, dict):
        if not isinstance(got, dict):
            good = False
        else:
            for k, w in want.items():
                if k in got and (p := type_problem(f"{key}.{k}", w, got[k])):
                    return p
            return None
    else:
        good = True
    if good:
        return None
    kind = "a finite number" if isinstance(want, float) or key in REAL else _type_name(want)
    return f"{key} is {_type_name(got)} ({got!r:.40}), expected {kind} (the release: {want!r:.40})"


def config_type_problems(cfg: dict) -> list[str]:
    out = [f"{k} is absent, expected {_type_name(RELEASE[k])} (the release: {RELEASE[k]!r:.40})"
           for k in REQUIRED if k not in cfg]
    if any(k.startswith("vision_") for k in cfg):
        out += [f"{k} is absent (the config has other vision_* fields), expected {_type_name(v)}"
                for k, v in fmt.VISION_EXP_FIELDS.items() if k not in cfg]
    if fmt.is_dspark_layout(cfg):
        out += [f"{k} is absent (the config has other dspark_* fields), expected {_type_name(RELEASE[k])}"
                for k in ("dspark_target_layer_ids", "dspark_markov_rank") if k not in cfg]
    out += [p for k, want in RELEASE.items() if k in cfg and (p := type_problem(k, want, cfg[k]))]
    return out


def config_value_problems(cfg: dict) -> list[str]:
    """Run only on a config whose types are the release's."""
    out = [f"{k} {cfg[k]!r} (the release and this datapath: {RELEASE[k]!r})" for k in FIXED
           if k in cfg and cfg[k] != RELEASE[k]]
    rope = cfg.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("type", "yarn") != "yarn":
        out.append(f"rope_scaling.type {rope.get('type')!r} (the release: 'yarn')")
    out += [f"{k} {cfg[k]} (must be at least 1)" for k in POSITIVE if k in cfg and cfg[k] < 1]
    out += [f"{k} {cfg[k]} (at most {AT_MOST.get(k, WIDEST)})" for k in POSITIVE
            if k in cfg and cfg[k] > AT_MOST.get(k, WIDEST)]
    if out:
        return out
    L = cfg["num_hidden_layers"]
    if not 0 <= cfg["num_hash_layers"] <= L:
        out.append(f"num_hash_layers {cfg['num_hash_layers']} (0 to num_hidden_layers {L})")
    if cfg["n_routed_experts"] < cfg["num_experts_per_tok"]:
        out.append(f"n_routed_experts {cfg['n_routed_experts']} < num_experts_per_tok {cfg['num_experts_per_tok']}")
    ratios = cfg["compress_ratios"]
    if len(ratios) < L or any(r not in (0, 4, 128) for r in ratios):
        out.append(f"compress_ratios of {len(ratios)} entries from {sorted(set(ratios))} (at least one per layer, "
                   f"{L}; each 0, 4 or 128)")
    ids = cfg.get("dspark_target_layer_ids")
    if ids is not None and (not ids or len(set(ids)) != len(ids) or any(not 0 <= i < L for i in ids)):
        out.append(f"dspark_target_layer_ids {ids} (distinct layer numbers below {L})")
    for k in ("bos_token_id", "eos_token_id"):
        if isinstance(cfg.get(k), int) and not 0 <= cfg[k] < cfg["vocab_size"]:
            out.append(f"{k} {cfg[k]} (an id below vocab_size {cfg['vocab_size']})")
    return out


def check_model_config(m: ModelFacts) -> list:
    if not m.path:
        return [skip("model.path", "no model path given")]
    if m.error:
        return [fail("model.path", f"reading {m.path} stopped on {m.error}", "a readable checkpoint directory",
                     "check the folder's permissions and disk; report this line if they are fine")]
    if not m.is_dir:
        what = {"missing": "does not exist", "file": "is a file"}.get(m.path_kind, f"is {m.path_kind}")
        fix = ("make the folder readable (chmod a+rx) by the user that runs the server"
               if m.path_kind.startswith("PermissionError") else f"download {OFFICIAL} and pass its directory")
        return [fail("model.path", f"{m.path} {what}, not a directory", "a local checkpoint directory", fix)]
    bad = json_problem(m.config, m.path, f"restore config.json from {OFFICIAL}")
    if bad:
        return [fail("model.config", bad[0], "the release's config.json (a JSON object)", bad[1])]
    cfg = m.config.value
    out = [ok("model.config", os.path.join(m.path, CONFIG))]
    types = config_type_problems(cfg)
    out.append(fail("model.config_types", f"config.json: {types[0]}" + (f" (+{len(types) - 1} more)" if types[1:]
                                                                            else ""),
                    "the release's JSON types for every field", "write the value as the release does (config.json "
                    f"of {OFFICIAL})") if types else ok("model.config_types", "the release's types"))
    if not types:
        values = config_value_problems(cfg)
        out.append(fail("model.config_values", f"config.json: {'; '.join(values[:3])}", "the release's values "
                        "for the fields the SM80 datapath is built around, positive widths",
                        f"restore those fields from {OFFICIAL}") if values else
                   ok("model.config_values", "the values this datapath runs"))
    arch, mt = cfg.get("architectures"), cfg.get("model_type")
    out.append(ok("model.architecture", str(arch)) if arch == ["DeepseekV4ForCausalLM"] else
               fail("model.architecture", f"{arch!r:.80}", "['DeepseekV4ForCausalLM']",
                    "dsv4-sm80 serves DeepSeek-V4-Flash / -Vision-Exp only"))
    out.append(ok("model.model_type", mt) if mt == "deepseek_v4" else
               fail("model.model_type", f"{mt!r:.80}", "'deepseek_v4'",
                    "V4.1 (deepseek_v41) and converted configs are not supported; use " + OFFICIAL))
    return out


def config_usable(m: ModelFacts) -> bool:
    cfg = m.config_dict
    return cfg is not None and not config_type_problems(cfg) and not config_value_problems(cfg)


# --- safetensors headers ----------------------------------------------------------------------------

def header_problem(h: HeaderFact) -> tuple[str, str] | None:
    """(problem, cause) for the first violation of the safetensors format, cause 'truncated' or 'corrupt'."""
    if h.error or h.entries is None:
        return h.error or "no header", "corrupt"
    seen, spans = set(), []
    for name, t in h.entries:
        if name == "__metadata__":
            if not isinstance(t, dict) or not all(isinstance(v, str) for v in t.values()):
                return "__metadata__ is not an object of strings", "corrupt"
            continue
        if name in seen:
            return f"tensor {name} is listed twice in the header", "corrupt"
        seen.add(name)
        if not isinstance(t, dict):
            return f"{name}: entry is {_type_name(t)}, not an object", "corrupt"
        dtype, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            return f"{name}: dtype {dtype!r:.30} is not a safetensors dtype", "corrupt"
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            return f"{name}: shape {shape!r:.60} is not a list of non-negative integers", "corrupt"
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int and o >= 0 for o in offs)
                or offs[1] < offs[0]):
            return f"{name}: data_offsets {offs!r:.60} is not [begin, end] with 0 <= begin <= end", "corrupt"
        need = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if offs[1] - offs[0] != need:
            return (f"{name}: data_offsets {offs} span {offs[1] - offs[0]} bytes, {dtype} {shape} is {need}",
                    "corrupt")
        spans.append((offs[0], offs[1], name))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin < pos:
            return f"{name}: data_offsets overlap another tensor's (begin {begin} < {pos})", "corrupt"
        if begin > pos:
            return f"{name}: {begin - pos} bytes of gap before it (the data must be contiguous)", "corrupt"
        pos = end
    need = 8 + h.header_len + pos
    if h.file.size < need:
        return f"truncated: {h.file.size} bytes, header needs {need}", "truncated"
    if h.file.size > need:
        return f"{h.file.size} bytes, header describes {need}", "corrupt"
    return None


def header_tensors(h: HeaderFact) -> dict:
    """name -> (dtype, shape) of a header that passed `header_problem`."""
    return {n: (t["dtype"], tuple(t["shape"])) for n, t in h.entries if n != "__metadata__"}


# --- the index and the shards -----------------------------------------------------------------------

def check_index(m: ModelFacts):
    bad = json_problem(m.index, m.path, f"restore {INDEX} from {OFFICIAL}")
    if bad:
        return fail("model.index", bad[0], "the index with a weight_map", bad[1])
    doc = m.index.value
    wm = doc.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        return fail("model.index", f"{INDEX}: weight_map is {_type_name(wm) if wm != {} else 'empty'}",
                    "an object of tensor name -> shard file", f"restore {INDEX} from {OFFICIAL}")
    if "metadata" in doc and not isinstance(doc["metadata"], dict):
        return fail("model.index", f"{INDEX}: metadata is {_type_name(doc['metadata'])}", "an object",
                    f"restore {INDEX} from {OFFICIAL}")
    outside = [(n, why) for n, s in wm.items() if (why := index_name_problem(s))]
    if outside:
        n, why = outside[0]
        return fail("model.index", f"{len(outside)} entries that SGLang would not load (e.g. {n} -> {why})",
                    "every entry a .safetensors file beside the index (SGLang loads only those)",
                    f"restore {INDEX} from {OFFICIAL} and keep the shards in the model folder")
    return ok("model.index", f"{len(wm)} tensors in {len(set(wm.values()))} shards")


SHARD_FIX = {
    "truncated": "re-download the named file(s); the hub lists each file's sha256 to compare",
    "corrupt": "re-download the named file(s): the safetensors library refuses them; the hub lists each sha256",
    "index": f"the index and the shards disagree: restore both from one download of {OFFICIAL}",
    "twice": "a tensor must live in one shard only (SGLang loads every copy, the last one wins): restore the "
             "release's shards",
}


def shard_problems(m: ModelFacts) -> list[tuple[str, str, str]]:
    """[(shard, problem, fix)], the shards in the index's order of names."""
    out, holder = [], {}
    for shard, h in sorted(m.shards.items()):
        bad = file_problem(h.file, m.path)
        if bad:
            out.append((shard, bad[0], bad[1]))
            continue
        hp = header_problem(h)
        if hp:
            out.append((shard, hp[0], SHARD_FIX[hp[1]]))
            continue
        for name in header_tensors(h):
            holder.setdefault(name, []).append(shard)
    for name, shards in holder.items():
        if len(shards) > 1:
            out.append((shards[-1], f"{name} is also stored in {shards[0]}", SHARD_FIX["twice"]))
            break
    if not out:
        for name, shard in m.weight_map.items():
            if shard not in holder.get(name, ()):
                out.append((shard, f"index lists {name} but the shard does not hold it", SHARD_FIX["index"]))
                break
    return out


def check_model_files(m: ModelFacts) -> list:
    names = ("model.quantization_config", "model.index", "model.shards", "model.keys",
             "model.dense_fp8", "model.experts", "model.vision", "model.tensors")
    if not m.path or not m.is_dir or m.error or m.config_dict is None:
        return [skip(n, "needs a readable model directory and config.json") for n in names]
    cfg = m.config_dict
    out = []
    q = cfg.get("quantization_config")
    q = q if isinstance(q, dict) else {}
    want_q = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    bad_q = {k: q.get(k) for k, v in want_q.items() if q.get(k) != v}
    out.append(ok("model.quantization_config", "fp8 e4m3, ue8m0, [128, 128]") if not bad_q else
               fail("model.quantization_config", f"{bad_q}", str(want_q),
                    f"the config was altered (converted checkpoint?); use {OFFICIAL}"))
    index = check_index(m)
    out.append(index)
    if index.status == "fail":
        return out + [skip(n, "needs the index") for n in names[2:]]
    problems = shard_problems(m)
    if problems:
        shard, why, fix = problems[0]
        out.append(fail("model.shards", f"{len(problems)} bad shard file(s): {shard}: {why}",
                        "every shard named by the index a complete safetensors file, each tensor in one shard", fix))
        return out + [skip(n, "needs every shard complete") for n in names[3:]]
    out.append(ok("model.shards", f"{len(m.shards)} shards complete"))
    if not config_usable(m):
        return out + [skip(n, "needs config.json with the release's types and values") for n in names[3:]]
    try:
        specs = fmt.inventory(cfg)
    except fmt.FormatError as e:
        out.append(fail("model.keys", f"config cannot describe a DSV4 checkpoint: {e}", "the official config.json",
                        f"use {OFFICIAL}"))
        return out + [skip(n, "needs the key inventory") for n in names[4:]]
    actual = {}
    for h in m.shards.values():
        actual.update(header_tensors(h))
    return out + compare_inventory(specs, actual, fmt.has_vision(cfg))


# --- tokenizer --------------------------------------------------------------------------------------

def check_tokenizer(m: ModelFacts):
    if not m.path or not m.is_dir or m.error:
        return skip("model.tokenizer", "needs a readable model directory")
    if not m.tokenizer_wanted:
        return skip("model.tokenizer", "the server does not load the checkpoint's tokenizer "
                                       "(--skip-tokenizer-init or --tokenizer-path)")
    want = "tokenizer.json and tokenizer_config.json as released (SGLang loads them at start)"
    restore = f"restore it from {OFFICIAL}, or serve token ids only with --skip-tokenizer-init"
    for name in TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES:
        j = m.tokenizer[name]
        if name in OPTIONAL_TOKENIZER_FILES and j.file.kind == "missing":
            continue
        bad = json_problem(j, m.path, restore)
        if bad:
            fix = bad[1] + ("; or serve token ids only with --skip-tokenizer-init" if j.file.kind == "missing" else "")
            return fail("model.tokenizer", bad[0], want, fix)
    tj, tc = m.tokenizer["tokenizer.json"].value, m.tokenizer["tokenizer_config.json"].value
    problem = None
    if not isinstance(tj.get("model"), dict):
        problem = f"tokenizer.json: model is {_type_name(tj.get('model'))}, expected an object"
    elif "added_tokens" in tj and not isinstance(tj["added_tokens"], list):
        problem = f"tokenizer.json: added_tokens is {_type_name(tj['added_tokens'])}, expected a list"
    else:
        for k in ("tokenizer_class", "bos_token", "eos_token", "pad_token", "chat_template"):
            if k in tc and not isinstance(tc[k], (str, dict, list, type(None))):
                problem = f"tokenizer_config.json: {k} is {_type_name(tc[k])}, expected a string"
                break
        for k in ("add_bos_token", "add_eos_token"):
            if problem is None and k in tc and not isinstance(tc[k], bool):
                problem = f"tokenizer_config.json: {k} is {_type_name(tc[k])}, expected a boolean"
    if problem is None and m.tokenizer_load_error:
        problem = f"tokenizer.json does not load in the tokenizers library ({m.tokenizer_load_error})"
    if problem:
        return fail("model.tokenizer", problem, want, restore)
    return ok("model.tokenizer", ", ".join(TOKENIZER_FILES))
