"""The Vision-Exp additions the VL wrapper carries beside the text model, and how
their weights are told apart from the text model's.

- `is_dsv4_vision(config)`: a DeepSeek-V4 config with the ten `vision_*` fields and a non-empty ViT.
- `split_vision_weights(weights, sink)`: the checkpoint's (name, tensor) stream with `vision.*`, `aligner.*`
  and `image_*` sent to `sink` and everything else passed on, so the text model's loader never sees them
  (stock 0.5.16 renames `aligner.w1` to `aligner.gate_up_proj` and dies on a KeyError).
- `VisionPart`: ViT + aligner + the four learned sentinel vectors, parameter names equal to the checkpoint
  keys, BF16 as stored (the ViT's RMSNorm weights are held in fp32 and computed in fp32). `load` refuses an
  unknown name or a shape that differs, `missing` lists what never arrived; `image_embeddings` turns one
  processor item (patches, ViT grid, block types and perm) into the whole block's embedding rows: START /
  PAD / NEW_LINE / END rows are the sentinel vectors, IMAGE rows the aligner rows in `perm` order — exactly
  what SGLang's multimodal embedding routine scatters over the block's positions.
"""

from __future__ import annotations

import torch
from torch import nn

from .image_processing import IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START, ImageBlock, block_embeddings
from .vit import VisionAligner, VisionTower

VISION_PREFIXES = ("vision.", "aligner.", "image_")
VISION_FIELDS = ("vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                 "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
                 "vision_max_wh_ratio")
SENTINELS = {IMAGE_START: "image_start", IMAGE_PAD: "image_pad", IMAGE_NEW_LINE: "image_newline",
             IMAGE_END: "image_end"}


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def is_dsv4_vision(config) -> bool:
    return (_get(config, "model_type") == "deepseek_v4"
            and all(_get(config, k) is not None for k in VISION_FIELDS)
            and int(_get(config, "vision_n_layers", 0)) > 0)


def split_vision_weights(weights, sink):
    """Yield the text model's (name, tensor) pairs; hand the vision ones to sink(name, tensor)."""
    for name, tensor in weights:
        if name.startswith(VISION_PREFIXES):
            sink(name, tensor)
        else:
            yield name, tensor


class VisionLoadError(RuntimeError):
    pass


class VisionPart(nn.Module):
    def __init__(self, config, dtype=torch.bfloat16):
        super().__init__()
        g = lambda k: _get(config, k)  # noqa: E731
        hidden = int(g("hidden_size"))
        self.vision = VisionTower(int(g("vision_dim")), int(g("vision_n_layers")), int(g("vision_n_heads")),
                                  int(g("vision_inter_dim")), int(g("vision_patch_size")),
                                  float(g("vision_rope_theta")))
        self.aligner = VisionAligner(int(g("vision_dim")), hidden, int(g("vision_downsample_ratio")))
        self.to(dtype)
        for m in self.vision.modules():  # RMSNorm weights stay fp32 (computed in fp32)
            if hasattr(m, "eps"):
                m.weight.data = m.weight.data.float()
        for name in SENTINELS.values():
            self.register_parameter(name, nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False))
        for p in self.parameters():
            p.requires_grad_(False)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        params = dict(self.named_parameters())
        if name not in params:
            raise VisionLoadError(f"vision weight {name}: not a parameter of the Vision-Exp ViT/aligner "
                                  "(a converted or different checkpoint?)")
        p = params[name]
        if tuple(tensor.shape) != tuple(p.shape):
            raise VisionLoadError(f"vision weight {name}: shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        p.data.copy_(tensor.to(p.dtype))
        self._loaded = getattr(self, "_loaded", set()) | {name}

    def missing(self) -> list[str]:
        loaded = getattr(self, "_loaded", set())
        return sorted(n for n, _ in self.named_parameters() if n not in loaded)

    @torch.no_grad()
    def image_embeddings(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int, types, perm) -> torch.Tensor:
        """One image's block: [len(types), hidden] in the text model's dtype."""
        dtype = self.image_start.dtype
        x = self.vision(patches.to(self.image_start.device, dtype), n_vit_h, n_vit_w)
        rows = self.aligner(x, n_vit_h, n_vit_w)
        vectors = {t: getattr(self, name) for t, name in SENTINELS.items()}
        return block_embeddings(ImageBlock(tuple(types), tuple(perm)), rows, vectors)

    def image_feature(self, items) -> torch.Tensor:
        """SGLang's `get_image_feature(items)`: the blocks of all items, in item order, concatenated."""
        return torch.cat([self.image_embeddings(it.feature, it.n_vit_h, it.n_vit_w, it.types, it.perm) for it in items])


def embeds_images(forward_batch) -> bool:
    """Whether this forward places image rows: an extend (prefill, chunk, mixed) of a batch with image inputs,
    the condition of SGLang's own `general_mm_embed_routine` (mm_utils.py:1222-1226). A decode or verify
    batch keeps its requests' mm_inputs but carries no extend lengths and no image positions (seen on the
    H200: the first decode after an image prefill died on extend_prefix_lens_cpu=None)."""
    mode = forward_batch.forward_mode
    return not mode.is_decode() and not mode.is_target_verify() and forward_batch.contains_mm_inputs()


class PartialImageBlock(RuntimeError):
    pass


def extend_image_spans(mm_inputs, prefix_lens, extend_lens) -> list:
    """Per request of an extend batch: the (IMAGE_START, IMAGE_END) absolute positions of the image blocks
    this extend computes. A block before the extend is cached already (its queries ran); a block split by the
    extend's edges is refused: its queries need every key of the block in one forward.
    The seam vision.whole_image_blocks (scheduling.py) keeps chunk cuts at block edges; this is the guard."""
    out = []
    for mm, prefix, n in zip(mm_inputs or [], prefix_lens, extend_lens):
        spans = []
        for item in getattr(mm, "mm_items", None) or []:
            types = getattr(item, "types", None)
            if types is None:
                continue
            (o_start, o_end), = item.offsets
            s, e = o_start + list(types).index(IMAGE_START), o_end
            if e < prefix:
                continue
            if s < prefix or e >= prefix + n:
                raise PartialImageBlock(
                    f"an image block [{s}, {e}] is split by this prefill chunk [{prefix}, {prefix + n}); the chunk "
                    "hook keeps cuts at block edges, so the prompt ends inside its last image block or a cached "
                    "prefix ends inside one: end the prompt after the image")
            spans.append((s, e))
        out.append(spans)
    return out


# --- the VL model class SGLang instantiates for a Vision-Exp checkpoint (not registered yet) ------------

def vl_model_class():
    """A subclass of SGLang's DeepseekV4ForCausalLM (so it inherits whatever the SM80 seams patched), named
    like it (the registry and the gate match the architecture string). A text-only config gets the plain
    text model. Adds the vision part, an fp32 `e_score_correction_bias_vl` [E] on every MoE gate (the name
    0.5.16's renamer gives `layers.N.ffn.gate.bias_vl`, so the text loader loads it), splits the vision
    weights off before the text loader and refuses a checkpoint whose vision weights are incomplete.

    Registered by the seam vision.model_class only with DSV4_SM80_VISION=1, together with the seams its
    serving depends on (bias_vl routing at the top-k call sites, input_embeds, the bidirectional window,
    whole image blocks per prefill chunk): without them it would serve images silently wrong."""
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM as Text

    class DeepseekV4ForCausalLM(Text):
        def __new__(cls, config, quant_config=None, prefix=""):
            if not is_dsv4_vision(config):
                obj = Text.__new__(Text)
                obj.__init__(config, quant_config, prefix)
                return obj
            return super().__new__(cls)

        def __init__(self, config, quant_config=None, prefix=""):
            super().__init__(config, quant_config, prefix)
            self.vision_part = VisionPart(config)
            experts = int(config.n_routed_experts)
            for layer in self.model.layers:
                mlp = getattr(layer, "mlp", None)
                gate = getattr(mlp, "gate", None)
                if gate is not None and not hasattr(gate, "e_score_correction_bias_vl"):
                    gate.e_score_correction_bias_vl = nn.Parameter(torch.zeros(experts, dtype=torch.float32),
                                                                   requires_grad=False)
                    if getattr(mlp, "topk", None) is not None:  # read by routing.topk_with_vl / hash_topk_with_vl
                        mlp.topk.correction_bias_vl = gate.e_score_correction_bias_vl

        def load_weights(self, weights, is_nextn=False):
            # the text loader checks every parameter of the model against what it loaded itself and would
            # warn "Some weights are not initialized" for all vision ones (seen on the H200), though the sink
            # loads them: the vision part is out of the module tree while the text weights load
            vision = self._modules.pop("vision_part")
            try:
                result = super().load_weights(split_vision_weights(weights, vision.load), is_nextn)
            finally:
                self._modules["vision_part"] = vision
            missing = self.vision_part.missing()
            if missing:
                raise VisionLoadError(f"the checkpoint lacks {len(missing)} Vision-Exp vision weight(s), e.g. "
                                      f"{missing[:3]}: re-download the official checkpoint (never a converted one)")
            return result

        def get_image_feature(self, items):
            return self.vision_part.image_feature(items)

        def pad_input_ids(self, input_ids, mm_inputs):
            from sglang.srt.managers.mm_utils import MultiModalityDataPaddingPatternMultimodalTokens

            return MultiModalityDataPaddingPatternMultimodalTokens().pad_input_tokens(input_ids, mm_inputs)

        @torch.no_grad()
        def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
            if input_embeds is not None or not embeds_images(forward_batch):
                return super().forward(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
            from sglang.srt.managers.mm_utils import general_mm_embed_routine

            # the ids before SGLang clamps them in place: image positions carry pad values >= vocab_size
            forward_batch.dsv4_routing_input_ids = input_ids.clone()
            # the image blocks of this extend, for the bidirectional window (window.py)
            forward_batch.dsv4_image_spans = extend_image_spans(
                forward_batch.mm_inputs, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu)
            hidden = general_mm_embed_routine(input_ids=input_ids, forward_batch=forward_batch,
                                              language_model=self.model,
                                              data_embedding_funcs={Modality.IMAGE: self.get_image_feature},
                                              positions=positions)
            if not self.pp_group.is_last_rank:
                return hidden
            aux = None
            if self.capture_aux_hidden_states:
                hidden, aux = hidden
            hidden, pre_hc_head = hidden
            return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux,
                                         hidden_states_before_norm=None if aux is not None else pre_hc_head)

    DeepseekV4ForCausalLM.__qualname__ = "DeepseekV4ForCausalLM"
    return DeepseekV4ForCausalLM


def text_forward_with_embeds(original, self, input_ids, positions, forward_batch, input_embeds=None,
                             pp_proxy_tensors=None):
    """Around DeepseekV4Model.forward (deepseek_v4.py:2250), which always embeds `input_ids` and ignores
    `input_embeds`: with embeddings given (the multimodal routine calls it with input_ids=None), the layers
    get those embeddings and the hash-routing layers the snapshot ids, clamped into the vocabulary (image
    rows are re-routed by bias_vl: the image mask is held for routing.topk_with_vl / hash_topk_with_vl for the
    duration of the forward)."""
    if input_embeds is None:
        return original(self, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
    ids = getattr(forward_batch, "dsv4_routing_input_ids", None)
    if ids is None:
        raise RuntimeError("DeepSeek-V4 with input_embeds needs forward_batch.dsv4_routing_input_ids (the VL "
                           "wrapper snapshots them before the multimodal routine)")
    from .routing import image_rows

    vocab = self.embed_tokens.org_vocab_size  # VocabParallelEmbedding: the unpadded vocabulary
    mask = ids >= vocab  # every image-block position carries a pad value past the vocabulary
    ids = ids.clamp(0, vocab - 1)

    class _Given(nn.Module):
        def forward(self, _ids):
            return input_embeds

    embed = self._modules["embed_tokens"]
    self._modules["embed_tokens"] = _Given()
    try:
        with image_rows(mask):
            return original(self, ids, positions, forward_batch, None, pp_proxy_tensors)
    finally:
        self._modules["embed_tokens"] = embed
