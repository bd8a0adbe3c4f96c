"""The two numerics of the reference, as hooks on transformers' DeepSeek-V4 modules, and the recorder of its
discrete choices.

R_x: the library model as loaded, exact fp32 arithmetic: no activation, KV or indexer rounding.
R_q: R_x plus the roundings DeepSeek's own inference code (`inference/model.py`, `kernel.py`) applies on
purpose, each switchable:
- kv: window KV (`self_attn.kv_norm`) and compressed attention KV of C4/C128 layers (`compressor.kv_norm`):
  the 448 non-rope dims FP8-simulated in blocks of 64; the 64 rope dims untouched. The official code rounds
  after RoPE; RoPE rotates only the trailing 64 dims, so rounding the norm's output is the same rounding.
- indexer: the indexer's query (after RoPE) and its compressed keys (after norm and RoPE) Hadamard-rotated,
  then FP4-simulated in blocks of 32, on their way into `indexer.scorer` (the keys are rounded from the
  library's unrounded store on every forward, which gives each key the same value every time).
- activations: FP8 per 128 columns with UE8M0 scales on the inputs of the linears whose checkpoint weight is
  FP8 and which the official code runs through its FP8 GEMM (wq_a, wq_b, wkv, wo_b, the indexer's wq_b, the
  shared expert's w1/w3/w2), and the routed experts' FP8 activations into their FP4 weights, with the routing
  weight multiplied in before w2's input is rounded, as the official expert does. Not rounded, as in the
  official code: wo_a (a BF16 einsum there), the compressors' wkv/wgate (fp32), the indexer's weights_proj
  (BF16), the router (fp32), the LM head (fp32).

Not modelled in either: the official code's BF16 storage of activations between ops and its BF16 weights
products. R_q adds the roundings the model was trained with; it is not a bit-replay of any engine.

Where transformers 5.12.1's model departs from DeepSeek's code or SGLang 0.5.16's `models/deepseek_v4.py`
by more than rounding (read for this lab; none changes the function the model computes on a teacher-forced
prefill from an empty cache):
- the routed experts' output is scaled by the routing weight after w2 (official: before w2; the same in
  exact arithmetic, different under activation rounding: R_q's expert forward follows the official order);
- the router divides the chosen weights by (sum + 1e-20) (official: by the sum);
- the sliding window keeps 127 earlier tokens in its decode cache and masks with a 128-token window
  (query included) on prefill, the official window of 128 tokens;
- the indexer marks not-yet-visible choices -1 and the attention drops them, as the official top-k does;
- SGLang 0.5.16 may run wo_a as an FP8 GEMM (its `_FP8_WO_A_GEMM` switch) where the official code uses BF16;
- the library caches compressor state across calls (decode) differently from the official ring buffers;
  the oracle never decodes: one forward per sequence, so the cache path only sees one prefill.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rounding import fp4_e2m1_simulate, fp8_e4m3_simulate, hadamard

KV_BLOCK, ACT_BLOCK, INDEXER_BLOCK = 64, 128, 32


@dataclass(frozen=True)
class Numerics:
    kv: bool = False
    indexer: bool = False
    activations: bool = False


NUMERICS = {
    "R_x": Numerics(),
    "R_q": Numerics(kv=True, indexer=True, activations=True),
    "R_q_kv": Numerics(kv=True, indexer=True, activations=False),
}


def rope_dim(config) -> int:
    return int(config.head_dim * config.rope_parameters["main"]["partial_rotary_factor"])


def exact_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    return fp8_e4m3_simulate(x, block).to(x.dtype)


def exact_fp4(x: torch.Tensor, block: int) -> torch.Tensor:
    return fp4_e2m1_simulate(x, block).to(x.dtype)


# The rounding sites, each built from the roundings it applies (`fp8(x, block)`, `fp4(x, block)`): the oracle's
# exact ones here, the training's straight-through ones in dsv4_lab.train.
def _round_nope(nope: int, fp8):
    def hook(_module, _args, out):
        return torch.cat([fp8(out[..., :nope], KV_BLOCK), out[..., nope:]], dim=-1)
    return hook


def _indexer_inputs(fp4):
    def hook(_module, args):
        q, keys, hidden = args
        return (fp4(hadamard(q), INDEXER_BLOCK).to(q.dtype), fp4(hadamard(keys), INDEXER_BLOCK).to(keys.dtype),
                hidden)
    return hook


def _act_input(fp8):
    def hook(_module, args):
        return (fp8(args[0], ACT_BLOCK), *args[1:])
    return hook


def _experts_forward(fp8):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        """The routed experts as the official code runs them: FP8 activations into w1/w3, the routing weight
        multiplied into the SwiGLU output, that product FP8-rounded into w2."""
        final = torch.zeros_like(hidden_states)
        xq = fp8(hidden_states, ACT_BLOCK)
        for expert in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == expert)
            act = self._apply_gate(F.linear(xq[token], self.gate_up_proj[expert]))
            act = act * top_k_weights[token, slot, None]
            out = F.linear(fp8(act, ACT_BLOCK), self.down_proj[expert])
            final = final.index_add(0, token, out.to(final.dtype))
        return final
    return forward


@contextlib.contextmanager
def applied(model, numerics: Numerics, *, fp8=exact_fp8, fp4=exact_fp4, layers=None, fp8_inputs=()):
    """The roundings of `numerics` on `model` (its decoder blocks, or `layers`; plus FP8 input rounding on the
    linears `fp8_inputs` with activations) for the duration of the block; the model is R_x after it."""
    nope = model.config.head_dim - rope_dim(model.config)
    handles, patched = [], []
    try:
        for layer in (model.model.layers if layers is None else layers):
            attn = layer.self_attn
            comp = attn.compressor
            if numerics.kv:
                handles.append(attn.kv_norm.register_forward_hook(_round_nope(nope, fp8)))
                if comp is not None:
                    handles.append(comp.kv_norm.register_forward_hook(_round_nope(nope, fp8)))
            if numerics.indexer and comp is not None and hasattr(comp, "indexer"):
                handles.append(comp.indexer.scorer.register_forward_pre_hook(_indexer_inputs(fp4)))
            if numerics.activations:
                linears = [attn.q_a_proj, attn.q_b_proj, attn.kv_proj, attn.o_b_proj,
                           layer.mlp.shared_experts.gate_proj, layer.mlp.shared_experts.up_proj,
                           layer.mlp.shared_experts.down_proj]
                if comp is not None and hasattr(comp, "indexer"):
                    linears.append(comp.indexer.q_b_proj)
                handles += [m.register_forward_pre_hook(_act_input(fp8)) for m in linears]
                experts = layer.mlp.experts
                experts.forward = types.MethodType(_experts_forward(fp8), experts)
                patched.append(experts)
        if numerics.activations:
            handles += [m.register_forward_pre_hook(_act_input(fp8)) for m in fp8_inputs]
        yield model
    finally:
        for h in handles:
            h.remove()
        for m in patched:
            del m.forward


class ChoiceRecorder:
    """Per layer, for one forward of one sequence (batch 1, positions 0..S-1): the routed expert ids and the
    selection-score gap between the last chosen and the first unchosen expert (NaN on hash layers, whose
    choice is a table lookup), and on C4 layers the indexer's chosen compressed entries with the score gap
    between the last chosen and the first unchosen visible entry (NaN where every visible entry is chosen)."""

    def __init__(self, model):
        self.model = model
        self.experts: dict[int, torch.Tensor] = {}
        self.expert_gap: dict[int, torch.Tensor] = {}
        self.indexer: dict[int, torch.Tensor] = {}
        self.indexer_gap: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self._scores: dict[int, torch.Tensor] = {}
        self._handles = []

    def __enter__(self):
        for i, layer in enumerate(self.model.model.layers):
            self._handles.append(layer.mlp.gate.register_forward_hook(self._gate(i, layer.mlp.gate)))
            self._handles.append(layer.register_forward_hook(self._layer(i)))
            comp = layer.self_attn.compressor
            if comp is not None and hasattr(comp, "indexer"):
                self._handles.append(comp.indexer.scorer.register_forward_hook(self._scorer(i)))
                self._handles.append(comp.indexer.register_forward_hook(self._indexer(i, comp.indexer)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _layer(self, i):
        def hook(_m, _a, out):
            self.hidden[i] = (out[0] if isinstance(out, tuple) else out).detach()[0].float().cpu()
        return hook

    def _gate(self, i, gate):
        def hook(_m, _a, out):
            logits, _weights, idx = out
            self.experts[i] = idx.detach().sort(dim=-1).values.cpu()
            if hasattr(gate, "e_score_correction_bias"):
                sel = gate.score_fn(logits.float()) + gate.e_score_correction_bias.float()
                top = sel.topk(idx.shape[-1] + 1, dim=-1).values
                self.expert_gap[i] = (top[:, -2] - top[:, -1]).detach().cpu()
            else:
                self.expert_gap[i] = torch.full((idx.shape[0],), float("nan"))
        return hook

    def _scorer(self, i):
        def hook(_m, _a, out):
            self._scores[i] = out.detach()[0]
        return hook

    def _indexer(self, i, indexer):
        def hook(_m, _a, out):
            chosen = out.detach()[0]  # [S, k], -1 where no entry is visible yet
            scores = self._scores.pop(i)  # [S, T]
            s, t = scores.shape
            visible = torch.arange(t, device=scores.device)[None, :] < ((torch.arange(s, device=scores.device) + 1)
                                                                        // indexer.compress_rate)[:, None]
            masked = scores.float().masked_fill(~visible, float("-inf"))
            k = indexer.index_topk
            gap = torch.full((s,), float("nan"))
            selects = visible.sum(-1) > k
            if bool(selects.any()):
                top = masked.topk(k + 1, dim=-1).values
                gap[selects.cpu()] = (top[:, k - 1] - top[:, k]).cpu()[selects.cpu()]
            self.indexer[i] = chosen.sort(dim=-1).values.cpu()
            self.indexer_gap[i] = gap
        return hook
