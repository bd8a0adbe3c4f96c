"""The text side of a DeepSeek-V4-Flash-Vision-Exp forward, as hooks on transformers 5.12.1's
`DeepseekV4ForCausalLM` (the model `dsv4_lab.oracle.load.load_reference` and `dsv4_lab.train.model.build` give):
image rows enter as input embeddings, image rows route by top-k of (scores + bias_vl), and inside each image span
the raw (sliding-window) attention sees the whole span both ways. Exact in fp32 and differentiable: the training
forward of a tiny Vision-Exp model as well as a reference.

Conventions, each with its source (note = the backport's design survey of PR #37253 and the public ports, kept
outside this repository; ref = DeepSeek's `inference/model.py` as transcribed in the public ports the note cites,
e.g. the mlx-lm Phase-3 reference file "model.py:283-305, 589-639, verbatim"; vLLM = vllm-project/vllm):
- Image rows: every position of an image block (alignment pads, START, IMAGE, NEW_LINE, row pads, END) takes a
  given embedding row instead of its token's embedding, before the mHC streams are formed (note 3.4 "Embedding of
  the block"; vLLM `vllm/models/deepseek_v4/common/vl_model.py` @ 40293fcc, `embed_input_ids`). The ids at image
  positions are ignored; the reference's ids (vocab_size + type) are accepted and read as 0 by the embedding and
  the hash table (ref `Gate.forward`: `tid2eid[torch.where(image_mask, 0, input_ids)]`).
- Routing, image rows (the same block positions, pads and sentinels included; ref `image_mask = input_ids >=
  vocab_size`, note 4.1): experts = top-k of (scores + bias_vl) on every layer; on hash layers that replaces the
  tid2eid lookup (note 4.1; ref `Gate.forward`; vLLM `vllm/model_executor/layers/fused_moe/router/dsv4_topk.py`,
  its bias_vl version: `if HAS_HASH and not is_image`). Weights = the UNBIASED scores at the chosen experts,
  normalised, times routed_scaling_factor: the bias only chooses (ref `weights = original_scores.gather(1,
  indices)`; vLLM dsv4_topk.py gathers `weights` = sqrt(softplus(logits)) without the bias). Normalisation as
  the library's router does it, sum + 1e-20 (the official code divides by the sum;
  `dsv4_lab/oracle/numerics.py` lists that departure), so an image row and a text row are computed alike.
- Routing, text rows: exactly the library's (tid2eid on hash layers, scores + e_score_correction_bias on the
  others); the hook leaves their ids and weights bit for bit.
- bias_vl: fp32 [n_routed_experts] on every decoder layer's gate, hash layers included, and on every MTP stage
  (`layers.{i}.ffn.gate.bias_vl`, `mtp.{j}.ffn.gate.bias_vl`; note 2.2, 4.1). It only moves a top-k choice, so
  no gradient reaches it: a parameter with requires_grad off (a balancing rule sets it, as it sets the correction
  bias; a public port's comment names the training's `noaux_tc_for_vl`, third-party only).
- Visible window (prefill from an empty cache; ref `get_image_visible`, `get_window_topk_idxs_visible`; note 5.1,
  5.2): a span runs from an IMAGE_START to the next IMAGE_END, both included (ref `valid = (cumsum(start) >
  cumsum(end)) | is_end`); a block's alignment pads lie before IMAGE_START and stay causal (note 5.1); row pads
  and the parity pad lie inside and are in the span. A query i in span [s, e] sees raw keys
  [max(0, min(i - W + 1, s)), e] (W = sliding_window, 128): the whole span both ways plus the part of its causal
  window before s. Every other query keeps the causal window [max(0, i - W + 1), i]. This is the reference's
  (left, right, width = W + max_image_tokens) rule wherever its clamps do not bind, i.e. for spans of at most
  max_image_tokens (`vision_max_n_token`, 384) positions; longer spans are refused. The compressed entries (C4
  through the indexer, C128), the compressors and the indexer are untouched and stay causal (note 5.2: the
  reference changes only the window indices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .image import IMAGE_END, IMAGE_START

DEFAULT_MAX_IMAGE_TOKENS = 384  # vision_max_n_token of the release (note 2.1)
ALIGN_PAD_MAX = 3  # alignment pads before IMAGE_START: 3 - start mod 4 (note 3.4)


# --- spans and the visible window --------------------------------------------------------------------------

def image_spans(input_ids: torch.Tensor, vocab_size: int) -> list[list[tuple[int, int]]]:
    """Per batch row, the (IMAGE_START, IMAGE_END) position pairs of ids in the reference's convention
    (image positions carry vocab_size + type)."""
    out = []
    for row in input_ids.reshape(-1, input_ids.shape[-1]).tolist():
        spans, open_at = [], None
        for pos, tok in enumerate(row):
            if tok == vocab_size + IMAGE_START:
                if open_at is not None:
                    raise ValueError(f"image spans: IMAGE_START at {pos} inside the span opened at {open_at}")
                open_at = pos
            elif tok == vocab_size + IMAGE_END:
                if open_at is None:
                    raise ValueError(f"image spans: IMAGE_END at {pos} with no IMAGE_START before it")
                spans.append((open_at, pos))
                open_at = None
        if open_at is not None:
            raise ValueError(f"image spans: IMAGE_START at {open_at} never closed (a block cut by the sequence end)")
        out.append(spans)
    return out


def block_span(layout) -> tuple[int, tuple[int, int]]:
    """(first position, (IMAGE_START position, IMAGE_END position)) of a `dsv4_lab.vision.image.BlockLayout`:
    the block's image rows are first .. first + len - 1; its span leaves the alignment pads out."""
    first = int(layout.start_pos)
    return first, (first + layout.kinds.index(IMAGE_START), first + len(layout.kinds) - 1)


def _per_row(spans, batch: int) -> list[list[tuple[int, int]]]:
    if spans is None:
        return [[] for _ in range(batch)]
    spans = list(spans)
    flat = all(len(s) == 2 and all(isinstance(v, int) for v in s) for s in spans)
    if flat and batch == 1:  # one row's spans given without the batch level
        spans = [spans]
    if len(spans) != batch:
        raise ValueError(f"visible window: spans for {len(spans)} rows, batch of {batch}")
    return [[(int(s), int(e)) for s, e in row] for row in spans]


def _check_spans(spans: Sequence[tuple[int, int]], seq_len: int, max_image_tokens: int) -> None:
    prev_end = -1
    for s, e in sorted(spans):
        if not 0 <= s <= e < seq_len:
            raise ValueError(f"visible window: span ({s}, {e}) outside positions 0..{seq_len - 1}")
        if s <= prev_end:
            raise ValueError(f"visible window: span ({s}, {e}) overlaps the one ending at {prev_end}")
        if e - s + 1 > max_image_tokens:
            # the reference's clamps would bind there; a block never gets that long (note 3.4: block <= 384)
            raise ValueError(f"visible window: span ({s}, {e}) of {e - s + 1} positions exceeds "
                             f"max_image_tokens={max_image_tokens}")
        prev_end = e


def visible_bounds(seq_len: int, spans: Sequence[tuple[int, int]], window: int,
                   max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per query position, int64 [seq_len]: the raw keys a query sees are lo..hi, both included."""
    _check_spans(spans, seq_len, max_image_tokens)
    pos = torch.arange(seq_len)
    lo, hi = (pos - (window - 1)).clamp(min=0), pos.clone()
    for s, e in spans:
        lo[s:e + 1] = lo[s:e + 1].clamp(max=s)
        hi[s:e + 1] = e
    return lo, hi


def visible_window(seq_len: int, spans: Sequence[tuple[int, int]], window: int,
                   max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS) -> torch.Tensor:
    """bool [seq_len (query), seq_len (key)]: which raw-window keys each query sees."""
    lo, hi = visible_bounds(seq_len, spans, window, max_image_tokens)
    key = torch.arange(seq_len)[None, :]
    return (key >= lo[:, None]) & (key <= hi[:, None])


# --- bias_vl -----------------------------------------------------------------------------------------------

def _blocks(model) -> tuple[list, str]:
    """The decoder blocks and their official prefix: a library model's layers, or a DSPARK draft's stages."""
    if hasattr(model, "stages"):  # dsv4_lab.train.draft.Draft
        return list(model.stages), "mtp"
    return list(model.model.layers), "layers"


def add_bias_vl(model, value: float = 0.0) -> dict[str, torch.nn.Parameter]:
    """Registers `mlp.gate.bias_vl` (fp32 [n_routed_experts], filled with `value`) on every block of `model` (a
    library model or a `Draft`) that lacks one; returns {official name: parameter}. The library's reverse key
    mapping then exports it as the checkpoint key (`official_names` in dsv4_lab.train.model)."""
    blocks, _ = _blocks(model)
    for block in blocks:
        gate = block.mlp.gate
        if getattr(gate, "bias_vl", None) is None:
            ref = gate.weight
            gate.bias_vl = torch.nn.Parameter(torch.full((gate.num_experts,), float(value), dtype=torch.float32,
                                                         device=ref.device), requires_grad=False)
    return bias_vl_weights(model)


def bias_vl_weights(model) -> dict[str, torch.nn.Parameter]:
    """{official name: parameter}: `layers.{i}.ffn.gate.bias_vl` of a library model, `mtp.{j}.ffn.gate.bias_vl`
    of a Draft's stages."""
    blocks, prefix = _blocks(model)
    out = {}
    for i, block in enumerate(blocks):
        p = getattr(block.mlp.gate, "bias_vl", None)
        if p is None:
            raise ValueError(f"bias_vl: {prefix}.{i} has none; call add_bias_vl first")
        out[f"{prefix}.{i}.ffn.gate.bias_vl"] = p
    return out


@torch.no_grad()
def load_bias_vl(model, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copies `tensors` (official name -> [n_routed_experts]) into the model's bias_vl, adding them first;
    every block's name must be present."""
    params = add_bias_vl(model)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise KeyError(f"bias_vl: no tensor for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    for name, p in params.items():
        p.copy_(tensors[name].to(p.dtype))


# --- the forward -------------------------------------------------------------------------------------------

class VisionText:
    """Context manager: while open, a forward of `model` called with `input_ids` of shape image_mask.shape runs
    as Vision-Exp's text side (module docstring):

        with VisionText(model, image_mask, spans, rows=rows):
            out = model(input_ids=ids, labels=labels)

    image_mask: bool [B, S], True at every image-block position. spans: per batch row a list of
    (IMAGE_START, IMAGE_END) positions (a flat list for B = 1). The image positions' input embeddings: `rows`,
    either [n, hidden] (one row per True of image_mask, row-major) or {position: row} ({(b, position): row} for
    B > 1); or `inputs_embeds` [B, S, hidden], the whole input (text positions included). The model needs bias_vl
    (`add_bias_vl`). Prefill from an empty cache only (the window is the prefill's). The target's layers only: a
    Draft's stages carry bias_vl for export, and the lab's draft runs on text blocks."""

    def __init__(self, model, image_mask: torch.Tensor, spans=None, rows=None, inputs_embeds=None,
                 max_image_tokens: int | None = None):
        if image_mask.dim() != 2 or image_mask.dtype != torch.bool:
            raise ValueError(f"VisionText: image_mask must be bool [batch, seq], got {image_mask.dtype} "
                             f"{tuple(image_mask.shape)}")
        if (rows is None) == (inputs_embeds is None) and bool(image_mask.any()):
            raise ValueError("VisionText: give the image rows as exactly one of rows= and inputs_embeds=")
        self.model = model
        cfg = model.config
        self.mask = image_mask
        self.flat = image_mask.reshape(-1)
        self.any_image = bool(image_mask.any())
        B, S = image_mask.shape
        self.max_image_tokens = int(max_image_tokens or getattr(cfg, "vision_max_n_token", None)
                                    or DEFAULT_MAX_IMAGE_TOKENS)
        self.spans = _per_row(spans, B)
        self.window = int(cfg.sliding_window)
        for b, row in enumerate(self.spans):
            _check_spans(row, S, self.max_image_tokens)
            covered = torch.zeros(S, dtype=torch.bool)
            for s, e in row:
                if not bool(image_mask[b, s:e + 1].all()):
                    raise ValueError(f"VisionText: span ({s}, {e}) of row {b} has positions outside image_mask")
                covered[max(0, s - ALIGN_PAD_MAX):e + 1] = True
            stray = (image_mask[b].cpu() & ~covered).nonzero().flatten().tolist()
            if stray:  # a block is [<= 3 alignment pads] START .. END: anything else has no span to see
                raise ValueError(f"VisionText: image positions {stray[:5]} of row {b} are neither in a span nor "
                                 "among the alignment pads just before one; give the spans")
        self.inputs_embeds = inputs_embeds
        if inputs_embeds is not None and tuple(inputs_embeds.shape[:2]) != (B, S):
            raise ValueError(f"VisionText: inputs_embeds {tuple(inputs_embeds.shape)} for a mask of {(B, S)}")
        self.rows = None if rows is None else self._rows(rows)
        self.extra = self._extra_window()
        self._handles, self._mask_cache = [], None

    # input embeddings
    def _rows(self, rows) -> torch.Tensor:
        where = self.mask.nonzero().tolist()  # row-major order
        if isinstance(rows, Mapping):
            B = self.mask.shape[0]
            keys = [(b, s) if B > 1 else s for b, s in where]
            extra = set(rows) - set(keys)
            if extra or len(rows) != len(keys):
                raise ValueError(f"VisionText: rows given at {sorted(extra)[:3]} and missing at "
                                 f"{[k for k in keys if k not in rows][:3]}; expected exactly the image positions")
            return torch.stack([rows[k] for k in keys]) if keys else torch.zeros(0, 0)
        if rows.dim() != 2 or rows.shape[0] != len(where):
            raise ValueError(f"VisionText: rows {tuple(rows.shape)} for {len(where)} image positions")
        return rows

    def _embed_ids(self, _module, args):
        ids = args[0]
        self._check_shape(ids, "embedding")
        return (torch.where(self.mask.to(ids.device), torch.zeros_like(ids), ids), *args[1:])

    def _embed_out(self, _module, _args, out):
        if self.inputs_embeds is not None:
            return self.inputs_embeds.to(device=out.device, dtype=out.dtype)
        if not self.any_image:
            return None
        b, s = self.mask.to(out.device).nonzero(as_tuple=True)
        return out.index_put((b, s), self.rows.to(device=out.device, dtype=out.dtype))  # out of place: grads reach rows

    # routing
    def _hash_ids(self, _module, args):
        hidden, ids = args[0], args[1] if len(args) > 1 else None
        if ids is None:
            raise ValueError("VisionText: hash layers route text rows by token id; call the model with input_ids")
        self._check_shape(ids, "hash router")
        return (hidden, torch.where(self.mask.to(ids.device), torch.zeros_like(ids), ids), *args[2:])

    def _route(self, gate, _args, out):
        if not self.any_image:
            return None
        logits, weights, indices = out
        if logits.shape[0] != self.flat.numel():
            raise ValueError(f"VisionText: router saw {logits.shape[0]} rows, image_mask has {self.flat.numel()}")
        scores = gate.score_fn(logits)
        vl = torch.topk(scores + gate.bias_vl, gate.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, vl)  # unbiased scores: bias_vl only chooses
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
        img = self.flat.to(logits.device)[:, None]
        return logits, torch.where(img, w, weights), torch.where(img, vl.to(indices.dtype), indices)

    # visible window
    def _extra_window(self):
        """bool [B, 1, S, S]: the keys the window adds to the causal one, or None if it adds none."""
        B, S = self.mask.shape
        if not any(self.spans):
            return None
        causal = visible_window(S, [], self.window, self.max_image_tokens)
        out = torch.stack([visible_window(S, row, self.window, self.max_image_tokens) & ~causal
                           for row in self.spans])
        return out[:, None] if bool(out.any()) else None

    def _open_window(self, _module, args, kwargs):
        if self.extra is None:
            return None
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
            raise ValueError("VisionText: the visible window needs the additive float mask of an eager-style "
                             f"attention, got {type(mask).__name__}")
        S = self.mask.shape[1]
        if tuple(mask.shape[-2:]) != (S, S):
            raise ValueError(f"VisionText: attention mask {tuple(mask.shape)} is not a prefill of {S} positions "
                             "from an empty cache")
        if self._mask_cache is None or self._mask_cache[0] is not mask:  # one mask object serves every layer
            opened = torch.where(self.extra.to(mask.device), torch.zeros((), dtype=mask.dtype, device=mask.device),
                                 mask)
            self._mask_cache = (mask, opened)
        return args, {**kwargs, "attention_mask": self._mask_cache[1]}

    def _check_shape(self, ids, where):
        if tuple(ids.shape) != tuple(self.mask.shape):
            raise ValueError(f"VisionText: {where} got ids {tuple(ids.shape)}, image_mask is "
                             f"{tuple(self.mask.shape)}")

    def __enter__(self):
        inner = self.model.model
        try:
            self._handles.append(inner.embed_tokens.register_forward_pre_hook(self._embed_ids))
            self._handles.append(inner.embed_tokens.register_forward_hook(self._embed_out))
            for i, layer in enumerate(inner.layers):
                gate = layer.mlp.gate
                if getattr(gate, "bias_vl", None) is None:
                    raise ValueError(f"VisionText: layer {i}'s gate has no bias_vl; call add_bias_vl(model) first")
                if hasattr(gate, "tid2eid"):
                    self._handles.append(gate.register_forward_pre_hook(self._hash_ids))
                # first among the gate's hooks, so any observer (ChoiceRecorder) sees the final routing
                self._handles.append(gate.register_forward_hook(self._route, prepend=True))
                self._handles.append(layer.self_attn.register_forward_pre_hook(self._open_window, with_kwargs=True))
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._mask_cache = None


def vision_forward(model, input_ids: torch.Tensor, rows=None, *, inputs_embeds=None, image_mask=None, spans=None,
                   max_image_tokens: int | None = None, **kwargs):
    """One Vision-Exp forward of `model` (the library's output object). image_mask defaults to
    input_ids >= vocab_size and spans to the IMAGE_START / IMAGE_END pairs, the reference's id convention
    (vocab_size + type at image positions); `kwargs` go to the model (labels, ...)."""
    vocab = int(model.config.vocab_size)
    if image_mask is None:
        image_mask = input_ids >= vocab
    if spans is None:
        spans = image_spans(input_ids, vocab)
    with VisionText(model, image_mask, spans, rows=rows, inputs_embeds=inputs_embeds,
                    max_image_tokens=max_image_tokens):
        return model(input_ids=input_ids, **kwargs)
