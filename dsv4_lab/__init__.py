"""The laboratory of dsv4-sm80: what a test bed needs and the product does not ship.

It plugs into the product's one applier through its own seam table (`dsv4_lab/seams.py: LAB_SEAMS`), applied
after the product's seams on the same target, only when the lab switch DSV4_SM80_LAB=1 is set. The product
never imports this package; the image does not contain it.

  knobs.py     the lab's environment knobs (LAB_KNOBS)
  seams.py     the lab's seam table (LAB_SEAMS)
  tripwire.py  every SM90/SM100-only entry point raises
  hygiene.py   KV pools poisoned after each cache flush
  memlog.py    GPU memory inside a serving process over time
  routes.py    the Vision-Exp routing trace
  mutants.py   named fault injections the accuracy runs must catch
  oracle/      the reference oracle (transformers' DeepSeek-V4, exact dequantization) and its metrics
  train/       a tiny DeepSeek-V4 trained on real text, and its draft
  vision/      a Vision-Exp oracle written from the release's ports, and a tiny trainable Vision-Exp
  beds/        the GPU test beds
  gpu/         the GPU suite that runs them as jobs (python -m dsv4_lab.gpu)
"""
