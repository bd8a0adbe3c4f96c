"""dsv4-sm80 injection: runs at the start of every Python process that has this directory on its
path (container: PYTHONPATH=/sgl-workspace/platform:/sgl-workspace/sm80-patch:/sgl-workspace/sglang/python).

ENABLE_SGLANG_DSV4_A100_PATCH unset or 0: nothing at all (native SGLang, the A/B switch), unless
DSV4_SM80_VISION=1 asks for the separate Vision-Exp overlay alone (native SGLang plus the VL model).
ENABLE_SGLANG_DSV4_A100_PATCH=1: `dsv4_sm80.bootstrap.install()` arranges for the seams to be
applied as SGLang imports its modules; it imports neither torch nor sglang here.
Either way, the next `sitecustomize` on sys.path (Python imports only the first one) still runs.
"""
# DSV4_SM80_SITECUSTOMIZE: marker, so a second copy of this file is never chained to itself.

import os as _os
import sys as _sys


def _boot():
    if (_os.environ.get("ENABLE_SGLANG_DSV4_A100_PATCH", "").strip() in ("", "0")
            and _os.environ.get("DSV4_SM80_VISION", "").strip() != "1"):
        return None
    try:
        from dsv4_sm80 import bootstrap
    except Exception as e:  # dsv4_sm80 not on the path: say so, loudly, in every process
        _sys.stderr.write(
            "dsv4-sm80: ENABLE_SGLANG_DSV4_A100_PATCH or DSV4_SM80_VISION is set but the overlay cannot be imported "
            f"({type(e).__name__}: {e}); put the dsv4_sm80 directory on PYTHONPATH "
            "(container: /sgl-workspace/sm80-patch). SGLang will run unpatched.\n"
        )
        return {"enabled": True, "installed": False, "error": f"{type(e).__name__}: {e}"}
    return bootstrap.install()


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
