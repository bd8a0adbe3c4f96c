"""dsv4-sm80 injection: runs at the start of every Python process that has this directory on its
path (container: PYTHONPATH=/sgl-workspace/platform:/sgl-workspace/sm80-patch:/sgl-workspace/sglang/python).

ENABLE_SGLANG_DSV4_A100_PATCH and DSV4_SM80_VISION unset or 0: nothing at all (native SGLang, the A/B switch).
Either one set: `dsv4_sm80.bootstrap.install()` arranges for the seams to be applied as SGLang imports its
modules (DSV4_SM80_VISION=1 alone: the Vision-Exp overlay on native SGLang); it imports neither torch nor sglang.
Where it cannot (a knob outside its column, the overlay not importable), this process refuses every SGLang
launch with one line naming the cause, rather than let SGLang run unpatched; other Python still runs.
Either way, the next `sitecustomize` on sys.path (Python imports only the first one) still runs.
"""
# DSV4_SM80_SITECUSTOMIZE: marker, so a second copy of this file is never chained to itself.

import os as _os
import sys as _sys

_SWITCHES = ("ENABLE_SGLANG_DSV4_A100_PATCH", "DSV4_SM80_VISION")
# What every SGLang launch imports before it parses its arguments or loads a model: `python -m
# sglang.launch_server`, the `sglang serve` entry point, sglang.Engine (and the HTTP server through it), and each
# scheduler process it spawns. `import sglang` imports none of them.
_LAUNCH_MODULES = ("sglang.launch_server", "sglang.cli.serve", "sglang.srt.entrypoints.engine",
                   "sglang.srt.managers.scheduler")


class LaunchRefused(SystemExit):
    """SGLang must not start: the overlay is switched on but cannot patch. A SystemExit, so the one line is all
    that prints and no `except Exception` in SGLang or a caller carries on."""


class _RefuseLaunches:
    """A meta-path finder that refuses SGLang's launch modules (it patches nothing)."""

    def __init__(self, line):
        self.line = line

    def find_spec(self, name, path=None, target=None):
        if name in _LAUNCH_MODULES:
            raise LaunchRefused(self.line)
        return None


def _boot():
    on = [n for n in _SWITCHES if _os.environ.get(n, "").strip() not in ("", "0")]
    if not on:
        return None
    try:
        from dsv4_sm80 import bootstrap
    except Exception as e:  # dsv4_sm80 not on the path, or broken
        error = f"{type(e).__name__}: {e}"
        state = {"enabled": True, "installed": False, "error": error, "refusal": (
            f"dsv4-sm80 refuses to launch SGLang: {on[0]}={_os.environ[on[0]].strip()} but the overlay cannot be "
            f"imported ({error}); put the directory holding dsv4_sm80 on PYTHONPATH (container: "
            f"/sgl-workspace/sm80-patch), or unset {' and '.join(on)} to run SGLang natively")}
    else:
        state = bootstrap.install()
    if state.get("refusal"):
        _sys.meta_path.insert(0, _RefuseLaunches(state["refusal"]))
    return state


def _chain():
    """Run the next sitecustomize on sys.path after this file's directory, if any."""
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    dirs = [_os.path.abspath(p or _os.getcwd()) for p in _sys.path]
    if here not in dirs:
        return None
    for d in dirs[dirs.index(here) + 1:]:
        path = _os.path.join(d, "sitecustomize.py")
        if not _os.path.isfile(path) or _os.path.samefile(path, __file__):
            continue
        with open(path, "rb") as f:
            if b"DSV4_SM80_SITECUSTOMIZE" in f.read():
                continue  # another copy of this file (e.g. an installed one)
        spec = importlib.util.spec_from_file_location("_dsv4_sm80_chained_sitecustomize", path)
        module = importlib.util.module_from_spec(spec)
        _sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return path
    return None


DSV4_SM80_STATE = _boot()
CHAINED = _chain()
