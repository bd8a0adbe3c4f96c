"""The lab's DeepSeek-V4-Flash-Vision-Exp: fp32, differentiable, written from the release's own description
(the public ports of DeepSeek's `inference/` code), not from `vision_backport/`; an oracle for the backport and
the forward of a tiny trainable Vision-Exp model.

  image.py  resize plan, pixels, ViT and LLM grids, the image token block layout at a prompt position
  tower.py  ViT + aligner + the four image-block vectors under the checkpoint's names
  text.py   the text side: image rows as embeddings, bias_vl routing, the bidirectional image window
  data.py   synthetic picture questions, their chat encoding and their judge
  train.py  the tiny Vision-Exp trained through this forward (`python -m dsv4_lab.vision train`)

Conventions and their sources: docs/vision.md.
"""

import os

# the committed trained tiny Vision-Exp (trained shape) and its record; `python -m dsv4_lab.vision unpack DIR`
TRAINED_ARCHIVE = os.path.join(os.path.dirname(__file__), "dsv4-lab-tiny-vl.tar.xz")
TRAINED_REPORT = os.path.join(os.path.dirname(__file__), "dsv4-lab-tiny-vl.json")
