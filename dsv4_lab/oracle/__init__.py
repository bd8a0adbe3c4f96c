"""The lab's reference oracle: transformers' DeepSeek-V4 model on an official-format checkpoint, exactly
dequantized, in fp32 (R_x), or with DeepSeek's own trained-in roundings hooked in (R_q); teacher-forced
log-probabilities per position, per-layer hidden states and discrete choices; and the metrics that measure
every serving path against it (`metrics.py`). `python -m dsv4_lab.oracle --help`; README.md beside this file.
"""
