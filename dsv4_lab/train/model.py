"""The tiny DeepSeek-V4 the lab trains: transformers' `DeepseekV4ForCausalLM` at a tiny preset's shape,
initialised by the tiny generator's rules, trained with the model's own roundings simulated (QAT), and
exported under the official checkpoint names.

- Shape: `PRESETS` (hidden 256, 5 layers: 2 sliding + hash, C4 with indexer, C128, C4; 16 heads of 512 in 8
  output groups; 8 experts of 128, top 6; 384 ids: the stand-in tokenizer's 14 special tokens, 256 bytes and
  fillers). `toy` is the CPU tests' (narrower, fewer heads, 4 layers). Native SGLang at TP1 takes only 64 or 128
  query heads (FlashMLA's sparse decode; it pads heads only above TP1), so the checkpoint is served widened to
  64 heads by an exact transform (`widen.py`); training runs at 16, a quarter of the attention's cost.
- Init: each tensor by its rule in `dsv4_sm80.checkpoint.format` (norms 1, biases 0, hash table id*7+k mod E,
  linears N(0, 0.02), mHC mixers N(0, 0.01)), drawn from the seed.
- QAT (`qat`): the hooks of `dsv4_lab.oracle.numerics` R_q (KV FP8, indexer Hadamard + FP4, FP8 activations
  into the FP8 linears and experts, the routing weight before w2's rounding), each rounding with a
  straight-through gradient (forward rounded, backward identity).
- Indexer (`indexer_distillation`): its top-k choice has no gradient, so, as DeepSeek trains its lightning
  indexer, it learns from a KL loss towards the main attention's weight on the compressed entries (summed
  over heads, renormalised over the chosen entries), on inputs detached from the model: only the indexer's
  own weights learn from it, and the language-model loss never reaches them.
- Export (`official_weights`): the library's own reverse key mapping (`revert_weight_conversion`) gives the
  official names; experts come back split into w1/w2/w3.
"""

from __future__ import annotations

import contextlib
import zlib

import torch

from dsv4_lab.oracle.numerics import Numerics, applied
from dsv4_lab.oracle.rounding import fp4_e2m1_simulate, fp8_e4m3_simulate
from dsv4_sm80.checkpoint import format as fmt
from dsv4_sm80.tiny.generate import HC_STD, WEIGHT_STD, TinySize, tiny_config

VOCAB = 384
PRESETS = {
    # the `unit` generator preset's widths over a byte vocabulary, a quarter of its heads (served widened x4)
    "tiny": TinySize(hidden=256, layers=5, heads=16, o_groups=8, q_lora=128, o_lora=128, moe_inter=128,
                     experts=8, vocab=VOCAB, markov_rank=64),
    # CPU tests: fewer heads, narrower (same layer pattern and formats)
    "toy": TinySize(hidden=128, layers=4, heads=8, o_groups=4, q_lora=128, o_lora=128, moe_inter=128,
                    experts=6, vocab=272, markov_rank=32),
}
QAT = Numerics(kv=True, indexer=True, activations=True)


def official_config(preset: str):
    return tiny_config(PRESETS[preset])


def library_config(cfg):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{k: v for k, v in cfg.items() if k != "quantization_config"})


def build(cfg, seed: int):
    """The library model of the official config `cfg`, fp32, every tensor by the generator's init rule."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(library_config(cfg)).float()
    model.config.use_cache = False
    model.config._attn_implementation = _register_mqa_attention()
    specs = {s.name: s for s in fmt.inventory(cfg)}
    names = official_names(model)
    with torch.no_grad():
        for lib_name, t in list(model.state_dict().items()):
            for off_name, part in names[lib_name]:
                _init(t if part is None else t[part], specs[off_name], seed, int(cfg["n_routed_experts"]))
    return model


def mqa_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The library's eager attention (mask, sink column, max subtracted, sink dropped) with the one shared KV
    head read once for all query heads: heads folded into rows instead of the KV copied per head."""
    B, H, S, D = query.shape
    k, v = key[:, 0], value[:, 0]
    w = (query.reshape(B, H * S, D) @ k.transpose(1, 2)).view(B, H, S, -1) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    sinks = module.sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)
    logits = torch.cat([w, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    out = (probs.reshape(B, H * S, -1) @ v).view(B, H, S, D)
    return out.transpose(1, 2).contiguous(), probs


def _register_mqa_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("dsv4_lab_mqa", mqa_attention)
    AttentionMaskInterface.register("dsv4_lab_mqa", eager_mask)  # the additive masks eager attention gets
    return "dsv4_lab_mqa"


def _init(t: torch.Tensor, spec: fmt.TensorSpec, seed: int, experts: int) -> None:
    rule = spec.init
    if rule == "ones":
        t.fill_(1.0)
    elif rule == "zeros":
        t.zero_()
    elif rule == "tid2eid":
        k = t.shape[1]
        t.copy_((torch.arange(t.shape[0])[:, None] * 7 + torch.arange(k)) % experts)
    else:
        std = HC_STD if rule == "hc_fn" else WEIGHT_STD
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{spec.name}".encode()))
        t.copy_(torch.randn(t.shape, generator=g) * std)


def official_names(model, state_dict=None) -> dict:
    """{library state-dict name: [(official name, index into the library tensor or None)]}: the library's
    reverse key mapping, applied to the whole state dict at once (its rules are ordered); each result is
    matched back to its source by tensor identity (a renaming does not copy). The fused experts are sliced
    here: gate_up_proj[e] is w1 over w3, down_proj[e] is w2."""
    from transformers.core_model_loading import revert_weight_conversion

    state_dict = model.state_dict() if state_dict is None else state_dict
    out, plain = {}, {}
    for name, t in state_dict.items():
        bare = name[len("model."):] if name.startswith("model.") else name
        if bare.endswith("mlp.experts.gate_up_proj"):
            layer, half = bare.split(".mlp.")[0], t.shape[1] // 2
            out[name] = [(f"{layer}.ffn.experts.{e}.w{k}.weight", (e, slice(lo, hi)))
                         for e in range(t.shape[0]) for k, lo, hi in ((1, 0, half), (3, half, None))]
        elif bare.endswith("mlp.experts.down_proj"):
            layer = bare.split(".mlp.")[0]
            out[name] = [(f"{layer}.ffn.experts.{e}.w2.weight", e) for e in range(t.shape[0])]
        else:
            plain[name] = t
    source = {id(t): name for name, t in plain.items()}
    rev = revert_weight_conversion(model, {k[len("model."):] if k.startswith("model.") else k: t
                                           for k, t in plain.items()})
    for off_name, t in rev.items():
        out[source[id(t)]] = [(_fix_compressor_name(off_name), None)]
    if len(out) != len(state_dict):
        raise RuntimeError(f"official names: {len(out)} of {len(state_dict)} library tensors mapped; "
                           "expected all (has transformers' DeepSeek-V4 key mapping changed?)")
    return out


# transformers 5.12.1's reverse mapping leaves these compressor and indexer leaves in its own spelling (its
# forward rules for them are not one-to-one); the official spelling, from the forward rules' sources:
_COMPRESSOR_LEAVES = (
    (".attn.indexer.gate_proj.", ".attn.indexer.compressor.wgate."),
    (".attn.indexer.kv_proj.", ".attn.indexer.compressor.wkv."),
    (".attn.indexer.kv_norm.", ".attn.indexer.compressor.norm."),
    (".attn.indexer.q_b_proj.", ".attn.indexer.wq_b."),
    (".attn.compressor.gate_proj.", ".attn.compressor.wgate."),
    (".attn.compressor.kv_proj.", ".attn.compressor.wkv."),
)


def _fix_compressor_name(name: str) -> str:
    if name.endswith(".attn.indexer.position_bias"):
        return name.replace(".attn.indexer.position_bias", ".attn.indexer.compressor.ape")
    for lib, off in _COMPRESSOR_LEAVES:
        if lib in name:
            return name.replace(lib, off)
    return name


def official_weights(model, state_dict=None) -> dict:
    """{official name: fp32 tensor} of the library model's weights (no scales: the writer quantizes)."""
    out = {}
    sd = model.state_dict() if state_dict is None else state_dict
    for lib_name, pairs in official_names(model, sd).items():
        t = sd[lib_name].detach()
        for off_name, part in pairs:
            out[off_name] = (t if part is None else t[part]).clone()
    return out


# --- QAT: the oracle's R_q roundings with straight-through gradients ---------------------------------------

def ste(rounded: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x + (rounded.to(x.dtype) - x).detach()


def fp8_ste(x, block):
    return ste(fp8_e4m3_simulate(x.detach(), block), x)


def fp4_ste(x, block):
    return ste(fp4_e2m1_simulate(x.detach(), block), x)


def qat(model, numerics: Numerics = QAT, layers=None, fp8_inputs=()):
    """The oracle's rounding sites (`dsv4_lab.oracle.numerics.applied`) with straight-through roundings, on the
    decoder blocks `layers` (default: the model's), plus FP8 input rounding on the linears `fp8_inputs`."""
    return applied(model, numerics, fp8=fp8_ste, fp4=fp4_ste, layers=layers, fp8_inputs=fp8_inputs)


@contextlib.contextmanager
def indexer_distillation(model):
    """Yields a list that, after a forward, holds one KL term per C4 layer (mean over queries that see a
    compressed entry): KL(attention's weights on the chosen entries || softmax of the index scores over them)."""
    terms, handles, scores = [], [], {}

    def detach_inputs(_m, args):
        return tuple(a.detach() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def keep_scores(i):
        def hook(_m, _a, out):
            scores[i] = out
        return hook

    def kl(i):
        def hook(_m, args, out):
            attn = out[1]  # [B, H, S, S + T]: the window's entries, then the compressed ones
            if attn is None or i not in scores:
                return
            idx = scores.pop(i)  # [B, S, T]
            t = idx.shape[-1]
            p = attn[..., -t:].detach().float().sum(1)  # [B, S, T]
            chosen = p > 0
            rows = chosen.any(-1)
            if not bool(rows.any()):
                return
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
            logq = torch.log_softmax(idx.float().masked_fill(~chosen, float("-inf")), dim=-1)
            per = torch.where(chosen, p * (torch.log(p.clamp_min(1e-30)) - logq), torch.zeros_like(p)).sum(-1)
            terms.append(per[rows].mean())
        return hook

    try:
        for i, layer in enumerate(model.model.layers):
            comp = layer.self_attn.compressor
            if comp is None or not hasattr(comp, "indexer"):
                continue
            handles.append(comp.indexer.register_forward_pre_hook(detach_inputs))
            handles.append(comp.indexer.scorer.register_forward_hook(keep_scores(i)))
            handles.append(layer.self_attn.register_forward_hook(kl(i)))
        yield terms
    finally:
        for h in handles:
            h.remove()
