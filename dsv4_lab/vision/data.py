"""Synthetic picture questions for a tiny Vision-Exp model: images made on the fly, questions whose answer is one
word, and the judge of an answer.

Kinds (`KINDS`):
- `colour`: one image of one colour; "What colour is the image?" -> the colour.
- `split`: one image in two colours, split left/right or top/bottom; "What colour is the <side> half?" -> the
  colour of that half.
- `shape`: a square or a disc of one colour on a background of another, in the left, right, top or bottom part;
  "Where is the <colour> <shape>?" -> the side.
- `two`: two images of one colour each; "What colour is the <first|second> image?" -> that image's colour.

Colours are jittered per image (each channel +-JITTER) and sizes and aspect ratios vary (3:1 either way at most,
sides 24 to 1,000 pixels), so the resize plan, the ViT grid and the aligner's grid vary from one image to the
next. An answer is right when it names the expected word and no other word of the same class (`judge`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (240, 220, 40),
           "white": (245, 245, 245), "black": (15, 15, 15), "orange": (245, 140, 20), "purple": (140, 40, 170)}
SIDES = ("left", "right", "top", "bottom")
SHAPES = ("square", "disc")
KINDS = ("colour", "split", "shape", "two")
JITTER = 20
ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2.0, 0.5, 3.0, 1 / 3)


@dataclass
class Example:
    kind: str
    images: list = field(default_factory=list)  # PIL RGB images
    question: str = ""
    answer: str = ""  # the one-word answer the model is trained to give

    def user_text(self, placeholder: str) -> str:
        """The user message's text as the chat encoding receives it: each image as the placeholder, then the
        question, content blocks joined by two newlines."""
        return "\n\n".join([placeholder] * len(self.images) + [self.question])

    def messages(self, data_urls: list[str]) -> list[dict]:
        """The OpenAI chat request's messages for this example, images as `image_url` blocks."""
        content = [{"type": "image_url", "image_url": {"url": u}} for u in data_urls]
        return [{"role": "user", "content": content + [{"type": "text", "text": self.question}]}]


def _jitter(rng: random.Random, rgb) -> tuple:
    return tuple(max(0, min(255, c + rng.randint(-JITTER, JITTER))) for c in rgb)


def _size(rng: random.Random, small: bool) -> tuple[int, int]:
    aspect = rng.choice(ASPECTS)
    long_side = rng.randint(24, 420) if small else rng.randint(24, 1000)
    w, h = (long_side, round(long_side / aspect)) if aspect >= 1 else (round(long_side * aspect), long_side)
    return max(8, w), max(8, h)


def _canvas(size, rgb):
    from PIL import Image

    return Image.new("RGB", size, rgb)


def _two_colours(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(sorted(COLOURS), 2)
    return a, b


def make(rng: random.Random, kind: str | None = None, small: bool = True) -> Example:
    """One example of `kind` (a random kind when None). `small` keeps the long side <= 420 pixels (a ViT grid of
    at most 30 x 30 patches after the resize plan); otherwise up to 1,000."""
    from PIL import ImageDraw

    kind = kind or rng.choice(KINDS)
    if kind == "colour":
        c = rng.choice(sorted(COLOURS))
        return Example(kind, [_canvas(_size(rng, small), _jitter(rng, COLOURS[c]))],
                       "What colour is the image? Answer with one word.", c)
    if kind == "split":
        a, b = _two_colours(rng)
        w, h = _size(rng, small)
        img = _canvas((w, h), _jitter(rng, COLOURS[a]))
        vertical = rng.random() < 0.5  # a left/right split
        box = (w // 2, 0, w, h) if vertical else (0, h // 2, w, h)
        ImageDraw.Draw(img).rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=_jitter(rng, COLOURS[b]))
        sides = ("left", "right") if vertical else ("top", "bottom")
        side = rng.choice(sides)
        return Example(kind, [img], f"What colour is the {side} half? Answer with one word.",
                       a if side == sides[0] else b)
    if kind == "shape":
        a, b = _two_colours(rng)  # shape colour, background colour
        w, h = _size(rng, small)
        img = _canvas((w, h), _jitter(rng, COLOURS[b]))
        side = rng.choice(SIDES)
        shape = rng.choice(SHAPES)
        r = max(2, int(min(w, h) * rng.uniform(0.12, 0.2)))
        cx = {"left": w // 4, "right": 3 * w // 4}.get(side, w // 2 + rng.randint(-w // 10, w // 10))
        cy = {"top": h // 4, "bottom": 3 * h // 4}.get(side, h // 2 + rng.randint(-h // 10, h // 10))
        draw = ImageDraw.Draw(img)
        (draw.rectangle if shape == "square" else draw.ellipse)([cx - r, cy - r, cx + r, cy + r],
                                                                 fill=_jitter(rng, COLOURS[a]))
        return Example(kind, [img], f"Where is the {a} {shape}? Answer with one word.", side)
    if kind == "two":
        a, b = _two_colours(rng)
        which = rng.choice(("first", "second"))
        return Example(kind, [_canvas(_size(rng, small), _jitter(rng, COLOURS[a])),
                              _canvas(_size(rng, small), _jitter(rng, COLOURS[b]))],
                       f"What colour is the {which} image? Answer with one word.", a if which == "first" else b)
    raise ValueError(f"synthetic example: kind {kind!r}, expected one of {', '.join(KINDS)}")


def held_out(n_per_kind: int, seed: int = 0, small: bool = True) -> list[Example]:
    """Examples from a stream no training run draws from (`training_rng` seeds by another string)."""
    rng = random.Random(f"held-out {seed}")
    return [make(rng, kind, small) for kind in KINDS for _ in range(n_per_kind)]


def training_rng(seed: int, step: int) -> random.Random:
    return random.Random(f"train {seed} {step}")


def judge(answer: str, ex: Example) -> bool:
    """Right when the answer names the expected word and no other word of its class (colours or sides)."""
    words = set(re.findall(r"[a-z]+", answer.lower()))
    vocab = set(SIDES) if ex.kind == "shape" else set(COLOURS)
    return ex.answer in words and not (words & vocab) - {ex.answer}


def data_url(img) -> str:
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# The chat encoding of one user turn and its answer, as SGLang's `encoding_dsv4.encode_messages(...,
# thinking_mode="chat")` renders it (a CPU test holds the two equal), so training needs no SGLang.
BOS_TEXT, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
END_THINK, EOS_TEXT = "</think>", "<｜end▁of▁sentence｜>"
PLACEHOLDER = "<｜deepseek_image｜>"
PLACEHOLDER_ID = 129264


def chat_text(ex: Example, with_answer: bool) -> str:
    text = BOS_TEXT + USER + ex.user_text(PLACEHOLDER) + ASSISTANT + END_THINK
    return text + ex.answer + EOS_TEXT if with_answer else text


def encode(text: str) -> list[int]:
    """The stand-in tokenizer's ids of `text` (special tokens whole, every other byte as BYTE_BASE + byte)."""
    from dsv4_lab.train.data import BYTE_BASE
    from dsv4_sm80.tiny.tokenizer import SPECIALS

    specials = {t: i for i, t in enumerate(SPECIALS)}
    specials[PLACEHOLDER] = PLACEHOLDER_ID
    pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    ids, pos = [], 0
    for m in pattern.finditer(text):
        ids += [BYTE_BASE + b for b in text[pos:m.start()].encode()]
        ids.append(specials[m.group()])
        pos = m.end()
    return ids + [BYTE_BASE + b for b in text[pos:].encode()]
