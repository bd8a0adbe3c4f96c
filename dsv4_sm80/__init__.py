"""dsv4-sm80: DeepSeek-V4-Flash on SGLang 0.5.16 on SM80 (A800/A100), as a runtime overlay.

Importing this package imports neither torch nor sglang (sitecustomize runs it in every process).
"""

__version__ = "0.1.0"
