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
        vision = env.get(env.VISION, environ) == "1"
    except env.EnvError as e:
        state["error"] = str(e)
        sys.stderr.write(f"dsv4-sm80: refusing to patch: {e}\n")
        return state
    if not state["enabled"] and not vision:
        return state
    if state["enabled"]:
        state["defaults_set"] = env.apply_import_time_defaults(environ)
        if "TRITON_CACHE_MANAGER" not in environ:  # a full disk named (triton_cache.py); a user's choice stays
            from .jitcache import TRITON_CACHE_MANAGER

            environ["TRITON_CACHE_MANAGER"] = TRITON_CACHE_MANAGER
            state["defaults_set"]["TRITON_CACHE_MANAGER"] = TRITON_CACHE_MANAGER
    else:  # the vision overlay alone on native SGLang: its image window rides FlashMLA's SWA lists, which
        # the native sparse-prefill branch (on by default) rebuilds without it (vision_backport/window.py)
        if env.NATIVE_VISION_PREFILL.name not in environ:
            environ[env.NATIVE_VISION_PREFILL.name] = "0"
            state["defaults_set"] = {env.NATIVE_VISION_PREFILL.name: "0"}
    # with the patch off and DSV4_SM80_VISION=1, only the vision overlay's seams are enabled (native A/B)
    state["installed"] = apply.install(environ)
    # The vision overlay comes second (container contract: A100 patch, then vision).
    import vision_backport

    state["vision"] = vision_backport.install(environ)
    return state
