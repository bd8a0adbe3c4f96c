"""What `sitecustomize` does when ENABLE_SGLANG_DSV4_A100_PATCH=1, in every Python process.

It must not import torch or sglang (no CUDA initialisation before SGLang spawns its workers): it
sets the import-time SGLang knobs the user left unset and installs the seam finder. The patches
themselves are applied later, module by module, as SGLang imports its own code.
"""

from __future__ import annotations

import os
import sys

from . import apply, env


def install(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    state = {"enabled": False, "installed": False, "defaults_set": {}, "vision": None, "error": None}
    try:
        state["enabled"] = env.patch_enabled(environ)
    except env.EnvError as e:
        state["error"] = str(e)
        sys.stderr.write(f"dsv4-sm80: refusing to patch: {e}\n")
        return state
    if not state["enabled"]:
        return state
    state["defaults_set"] = env.apply_import_time_defaults(environ)
    state["installed"] = apply.install(environ)
    # The vision overlay comes second (container contract: A100 patch, then vision).
    import vision_backport

    state["vision"] = vision_backport.install(environ)
    return state
