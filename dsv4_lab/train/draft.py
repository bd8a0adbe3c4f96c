"""The DSPARK draft (`mtp.0..N-1`) in plain PyTorch, trained against the frozen target.

Facts taken from SGLang 0.5.16 (paths under `sglang/srt/`):
- The target's features: after each layer of `dspark_target_layer_ids`, the layer's completed mHC state
  [T, hc, H] averaged over the hc streams (`models/deepseek_v4.py:2337-2344`), the layers' features
  concatenated, projected by `mtp.0.main_proj` and normed by `mtp.0.main_norm`
  (`models/deepseek_v4_dspark.py:649-652`); every stage's own `wkv` + `kv_norm` + RoPE turns that into the
  stage's window KV at the target's positions (`:654-678`).
- The block: gamma = `dspark_block_size` ids, the last accepted (bonus) token then the mask id
  (`speculative/dspark_components/dspark_draft.py:355-358`), which is `dspark_noise_token_id`
  (`speculative/dspark_components/dspark_config.py:250-252`), at positions prefix..prefix+gamma-1 (`:359`),
  embedded by the target's embedding and repeated over the hc streams
  (`models/deepseek_v4_dspark.py:680-688`).
- Attention: every block query sees the last min(prefix, 128) context entries and all gamma block entries,
  no causal order inside the block (`speculative/dspark_components/kernels/dspark_attn_metadata.py:143-151`,
  `:280-286`: the same page list and length context + gamma for each query); the stage attention is the
  model's MQA with sink, per-head RMS-normed query, partial RoPE on the last 64 dims, inverse RoPE on the
  output, grouped wo_a, wo_b (`models/deepseek_v4_dspark.py:154-266`), plain RoPE (`rope_original_seq_len=0`,
  `:97`).
- A stage is a decoder block with mHC around attention and the MoE (`:528-549`); the stages run in order on
  the block (`:700-706`).
- Logits: the last stage's hc head, its `norm`, the target's LM head (`:708-739`), plus the Markov bias
  `markov_w2(markov_w1(previous token))`, the previous token being the bonus token for the first position and
  the sampled one after (`models/dspark.py:32-62`, `models/deepseek_v4_dspark.py:346-373`); block position j
  predicts the token at prefix + j + 1 (`dspark_draft.py:81-92`).
- Confidence: sigmoid(proj([hc-head output, markov_w1(previous token)])), no bias
  (`models/dspark.py:287-328`, `models/deepseek_v4_dspark.py:417-440`, `:741-765`).
- Scale head_dim^-0.5 (`models/deepseek_v4.py:419`); the hc head is transformers' `DeepseekV4HyperHead`'s
  arithmetic (`models/deepseek_v4.py:273-288`).

Training: teacher-forced (previous tokens are the text's), cross-entropy of each block position's logits,
plus the confidence head's BCE against whether that position's argmax is the text's token. The target is
frozen; both run with the QAT roundings (`model.qat`: the stages' KV, FP8 activations into their FP8
linears and experts, and into main_proj, FP8 in the checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import library_config, mqa_attention, official_weights


class Draft(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

        self.n = len(cfg["dspark_target_layer_ids"])
        self.targets = list(cfg["dspark_target_layer_ids"])
        self.gamma = int(cfg["dspark_block_size"])
        self.noise = int(cfg["dspark_noise_token_id"])
        self.cfg = dict(cfg, num_hidden_layers=self.n, compress_ratios=[0] * self.n, num_hash_layers=0)
        lib = library_config(self.cfg)
        lib._experts_implementation = "eager"  # stages built outside a model get no dispatch of their own
        self.lib = lib
        H, V, R = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["dspark_markov_rank"])
        self.stages = nn.ModuleList(mdl.DeepseekV4DecoderLayer(lib, s) for s in range(self.n))
        self.main_proj = nn.Linear(H * self.n, H, bias=False)
        self.main_norm = mdl.DeepseekV4RMSNorm(H, eps=lib.rms_norm_eps)
        self.norm = mdl.DeepseekV4RMSNorm(H, eps=lib.rms_norm_eps)
        self.hc_head = mdl.DeepseekV4HyperHead(lib)
        self.markov_w1 = nn.Embedding(V, R)
        self.markov_w2 = nn.Linear(R, V, bias=False)
        self.confidence = nn.Linear(H + R, 1, bias=False)
        self._rope = mdl.apply_rotary_pos_emb

    # --- forward ----------------------------------------------------------------------------------------
    def _context_kv(self, attn, main_x, b, pos_ctx, rope):
        """[N, 1, W, D]: the stage's KV of every position of the projected features main_x [B, S, H], computed
        once per position (KV depends only on the row and its position), then gathered per block."""
        B, S, _ = main_x.shape
        pos = torch.arange(S, device=main_x.device).expand(B, S)
        cos, sin = rope(main_x, pos)
        kv = self._rope(attn.kv_norm(attn.kv_proj(main_x))[:, None], cos, sin)[:, 0]
        return kv[b[:, None], pos_ctx][:, None]

    def _attention(self, attn, h, kv_c, pos_blk, ctx_valid, rope):
        """h [N, g, H] block rows, kv_c [N, 1, W, D] the context's KV; returns [N, g, H]."""
        N, g, _ = h.shape
        D = attn.head_dim
        cos_b, sin_b = rope(h, pos_blk)
        q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(h))).view(N, g, -1, D).transpose(1, 2)
        q = self._rope(attn.q_b_norm(q), cos_b, sin_b)
        kv_b = self._rope(attn.kv_norm(attn.kv_proj(h))[:, None], cos_b, sin_b)
        kv = torch.cat([kv_c, kv_b], dim=2)  # [N, 1, W + g, D]
        visible = torch.cat([ctx_valid, ctx_valid.new_ones(N, g)], dim=1)[:, None, None, :]
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
        o, _ = mqa_attention(attn, q, kv, kv, mask, attn.scaling)  # [N, g, heads, D]
        o = self._rope(o, cos_b, -sin_b, unsqueeze_dim=2)
        grouped = attn.o_a_proj(o.reshape(N, g, attn.config.o_groups, -1)).flatten(2)
        return attn.o_b_proj(grouped)

    def forward(self, target, ids, feats, anchors):
        """ids [B, S]; feats [B, S, n, H] the target's features; anchors [N, 2] (row, prefix) with
        1 <= prefix and prefix + gamma < S. Returns (logits [N, g, V], confidence logit [N, g], labels)."""
        g, W = self.gamma, int(self.cfg["sliding_window"])
        b, p = anchors[:, 0], anchors[:, 1]
        ar = torch.arange(g, device=ids.device)
        pos_blk = p[:, None] + ar
        pos_ctx = p[:, None] - W + torch.arange(W, device=ids.device)
        ctx_valid = pos_ctx >= 0
        pos_ctx = pos_ctx.clamp(min=0)
        main_x = self.main_norm(self.main_proj(feats.flatten(-2)))
        block = torch.full_like(pos_blk, self.noise)
        block[:, 0] = ids[b, p]
        x = target.model.embed_tokens(block)
        x = x[:, :, None].expand(-1, -1, self.lib.hc_mult, -1).contiguous()
        rotary = target.model.rotary_emb

        def rope(like, pos):
            return rotary(like, position_ids=pos, layer_type="main")

        for st in self.stages:
            post, comb, col = st.attn_hc(x)
            kv_c = self._context_kv(st.self_attn, main_x, b, pos_ctx, rope)
            a = self._attention(st.self_attn, st.input_layernorm(col), kv_c, pos_blk, ctx_valid, rope)
            x = post.unsqueeze(-1) * a.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
            post, comb, col = st.ffn_hc(x)
            m = st.mlp(st.post_attention_layernorm(col))
            x = post.unsqueeze(-1) * m.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
        x_post = self.hc_head(x)
        labels = ids[b[:, None], pos_blk + 1]
        prev = torch.cat([block[:, :1], labels[:, :-1]], dim=1)
        mk = self.markov_w1(prev)
        logits = target.lm_head(self.norm(x_post)) + self.markov_w2(mk)
        conf = self.confidence(torch.cat([x_post, mk], dim=-1)).squeeze(-1)
        return logits, conf, labels

    def loss(self, target, ids, feats, anchors):
        logits, conf, labels = self(target, ids, feats, anchors)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        hit = (logits.argmax(-1) == labels).float()
        return ce + F.binary_cross_entropy_with_logits(conf, hit), ce, hit.mean()

    # --- export -----------------------------------------------------------------------------------------
    def official_weights(self, target) -> dict:
        """{official mtp.* name: tensor}: each stage under the target's key mapping as layer s, renamed."""
        out = {}
        for s, st in enumerate(self.stages):
            sd = {f"model.layers.{s}.{k}": v for k, v in st.state_dict().items()}
            for name, t in official_weights(target, sd).items():
                out["mtp." + name[len("layers."):]] = t
        out.update(self.own_params())
        return {k: v.detach().clone() for k, v in out.items()}

    def own_params(self) -> dict:
        """{official name: parameter} of the draft's tensors outside its stages."""
        last = f"mtp.{self.n - 1}"
        return {
            "mtp.0.main_proj.weight": self.main_proj.weight, "mtp.0.main_norm.weight": self.main_norm.weight,
            f"{last}.norm.weight": self.norm.weight, f"{last}.hc_head_fn": self.hc_head.hc_fn,
            f"{last}.hc_head_base": self.hc_head.hc_base, f"{last}.hc_head_scale": self.hc_head.hc_scale,
            f"{last}.markov_head.markov_w1.weight": self.markov_w1.weight,
            f"{last}.markov_head.markov_w2.weight": self.markov_w2.weight,
            f"{last}.confidence_head.proj.weight": self.confidence.weight,
        }


def capture_features(target, ids, layer_ids) -> torch.Tensor:
    """[B, S, n, H]: after each target layer of layer_ids, its mHC state averaged over the streams."""
    got, handles = {}, []
    for i in layer_ids:
        handles.append(target.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: got.__setitem__(i, (out[0] if isinstance(out, tuple) else out).mean(dim=2))))
    try:
        target(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([got[i] for i in layer_ids], dim=2)


def init_draft(draft: Draft, seed: int) -> None:
    """The tiny generator's rules (norms 1, biases 0, linears N(0, 0.02), mHC N(0, 0.01)), seeded."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight" or name.endswith(("hc.scale", "hc_scale")):
                p.fill_(1.0)
            elif name.endswith(("sinks", ".base", "hc_base")):
                p.zero_()
            else:
                std = 0.01 if name.endswith((".fn", "hc_fn")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for st in draft.stages:
            st.mlp.gate.e_score_correction_bias.zero_()


def read_official(ckpt: str):
    """name -> the checkpoint's tensor as fp32, FP8 blocks and MXFP4 experts dequantized exactly; and the names."""
    import json
    import os

    from safetensors import safe_open

    from dsv4_sm80.kernels.w4a8_moe_ref import dequant_mxfp4

    wm = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]

    def get(name):
        with safe_open(os.path.join(ckpt, wm[name]), "pt") as f:
            return f.get_tensor(name)

    def read(name):
        t = get(name)
        if t.dtype == torch.float8_e4m3fn:
            s = get(name[:-len("weight")] + "scale").float()
            full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:t.shape[0], :t.shape[1]]
            return t.float() * full
        if t.dtype == torch.int8:
            return dequant_mxfp4(t, get(name[:-len("weight")] + "scale")).float()
        return t.float()
    return read, wm


@torch.no_grad()
def load_draft(ckpt: str) -> Draft:
    """The checkpoint's mtp.* stages in a Draft (the inverse of `Draft.official_weights`)."""
    import json
    import os

    from transformers import DeepseekV4ForCausalLM

    from .model import official_names

    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    draft = Draft(cfg)
    # the names come from a plain library model: a quantization-loaded one maps its tensors through copies
    namer = DeepseekV4ForCausalLM(library_config(cfg))
    read, wm = read_official(ckpt)
    done = set()
    for s, st in enumerate(draft.stages):
        sd = {f"model.layers.{s}.{k}": v for k, v in st.state_dict().items()}
        for lib_name, pairs in official_names(namer, sd).items():
            for off, part in pairs:
                name = "mtp." + off[len("layers."):]
                dst = sd[lib_name] if part is None else sd[lib_name][part]
                dst.copy_(read(name).view(dst.shape))
                done.add(name)
    for name, p in draft.own_params().items():
        p.copy_(read(name).view(p.shape))
        done.add(name)
    want = {n for n in wm if n.startswith("mtp.") and not n.endswith(".scale")}
    if want != done:
        raise RuntimeError(f"draft load: {sorted(want - done)[:5]} in {ckpt} not loaded, {sorted(done - want)[:5]} "
                           "loaded but absent; expected the official mtp.* names")
    return draft.eval()
