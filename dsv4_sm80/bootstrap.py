"""What `sitecustomize` does when the SM80 patch or the vision overlay is switched on, in every Python process.

It must not import torch or sglang (no CUDA initialisation before SGLang spawns its workers): it checks the env
contract, sets the import-time SGLang knobs the user left unset and installs the seam finder. The patches
themselves are applied later, module by module, as SGLang imports its own code.

Nothing is installed half-way: a knob outside its column, or the lab switch on without the lab, installs nothing
and returns the one line `sitecustomize` refuses every SGLang launch of this process with.
"""

from __future__ import annotations

import os

from . import apply, env

REFUSAL = "dsv4-sm80 refuses to launch SGLang: "


def contract_refusal(environ) -> str | None:
    """The gate's env.knobs line when a dsv4-sm80 knob holds a value outside its column, else None."""
    for knob in env.KNOBS:
        try:
            env.get(knob, environ)
        except env.EnvError:
            from .gate.checks import check_env_knobs

            knobs = {k.name: v for k in env.KNOBS if (v := environ.get(k.name)) is not None}
            return check_env_knobs(knobs).line()
    return None


def install(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    state = {"enabled": False, "installed": False, "defaults_set": {}, "error": None, "refusal": None}
    problem = contract_refusal(environ)
    if problem is None:
        try:
            apply.all_seams(environ)  # the lab's table, when its switch is on
        except apply.LabMissing as e:
            problem = str(e)
    if problem is not None:
        state.update(error=problem, refusal=REFUSAL + problem)
        return state
    state["enabled"] = env.patch_enabled(environ)
    if not state["enabled"] and env.get(env.VISION, environ) != "1":
        return state
    if state["enabled"]:
        state["defaults_set"] = env.apply_import_time_defaults(environ)
        if "TRITON_CACHE_MANAGER" not in environ:  # a full disk named (triton_cache.py); a user's choice stays
            from .jitcache import TRITON_CACHE_MANAGER

            environ["TRITON_CACHE_MANAGER"] = TRITON_CACHE_MANAGER
            state["defaults_set"]["TRITON_CACHE_MANAGER"] = TRITON_CACHE_MANAGER
    elif env.NATIVE_VISION_PREFILL.name not in environ:
        # the vision overlay alone on native SGLang: its image window rides FlashMLA's SWA lists, which the native
        # sparse-prefill branch (on by default) rebuilds without it (vision_backport/window.py)
        environ[env.NATIVE_VISION_PREFILL.name] = "0"
        state["defaults_set"] = {env.NATIVE_VISION_PREFILL.name: "0"}
    # with the patch off and DSV4_SM80_VISION=1, only the vision overlay's seams are enabled (native A/B)
    state["installed"] = apply.install(environ)
    return state
