"""The one applier of the seam table.

`install()` (called by `sitecustomize` when ENABLE_SGLANG_DSV4_A100_PATCH=1) puts a finder at the
front of `sys.meta_path`. When SGLang imports a module that holds a seam target, the finder wraps
that module's loader so that, for that module:

1. before it executes: its file must be the 0.5.16 file (`upstream.FINGERPRINTS`);
2. it executes unchanged;
3. after it executes, before anyone can `from X import Y` a stale copy: each enabled seam is
   applied exactly once, and copies already bound in other modules are re-pointed.

A missing or changed target raises `SeamRefusal`, which derives from BaseException on purpose:
SGLang imports some modules under `except Exception` (e.g. its model registry), and a refusal
must stop the process rather than degrade into a missing model class.

The Vision-Exp overlay's table (`vision_backport.seams.VISION_SEAMS`) is appended to the product's, and the
lab's (`dsv4_lab`, a separate package never in the image) after both, only with DSV4_SM80_LAB=1: on a shared target
the later tables' seams wrap the earlier ones'. That switch and the guarded import in `lab_seams` are all the product
knows of the lab.

Why our own finder rather than SGLang 0.5.16's plugin entry points + HookRegistry: HookRegistry logs and continues
when a hook fails (`hook_registry.py`, apply_hooks), it applies only when `load_plugins()` runs, after many sglang
modules are imported (so import-time constants and `from X import Y` copies are already taken), it needs a
`.dist-info` on the path, and `SGLANG_PLUGINS` can silently exclude it. Patching at import time, with a fingerprint
check before the module runs, keeps the refuse-or-run promise.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import sys
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from vision_backport.seams import VISION_SEAMS

from . import env
from .seams import SEAMS, Seam, by_module
from .upstream import FINGERPRINTS, file_hash, module_relpath

MARK = "__dsv4_sm80_seam__"


class SeamRefusal(BaseException):
    """A seam target is missing or is not SGLang 0.5.16's code. Nothing may run on top of it."""


class LabMissing(SeamRefusal):
    """DSV4_SM80_LAB=1 but the lab package cannot be imported: a lab run must not quietly run without its seams."""


def lab_seams(environ=None) -> tuple[Seam, ...]:
    """The lab's seams when the lab switch is on, else (). (Importing the lab's table registers its knobs with
    `env`, so lab seams' toggles can name them.)"""
    if not env.lab_enabled(environ):
        return ()
    try:
        from dsv4_lab.seams import LAB_SEAMS
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("dsv4_lab"):
            raise
        raise LabMissing(
            f"dsv4-sm80 lab: {env.LAB.name}=1 but the lab package cannot be imported ({e}); expected dsv4_lab "
            "beside dsv4_sm80 on PYTHONPATH (a checkout of the repository, never the image); fix: put the "
            f"repository root on PYTHONPATH, or unset {env.LAB.name}"
        ) from None
    return tuple(LAB_SEAMS)


def all_seams(environ=None) -> tuple[Seam, ...]:
    """The product's seams, the vision overlay's, then the lab's (only with DSV4_SM80_LAB=1)."""
    return (*SEAMS, *VISION_SEAMS, *lab_seams(environ))


@dataclass
class SeamStatus:
    name: str
    target: str
    kind: str
    upstream: str
    toggle: str
    state: str  # off | pending | applied | refused
    detail: str = ""
    applied_count: int = 0


_lock = threading.RLock()
_status: dict[str, SeamStatus] = {}
_finder: SeamFinder | None = None


def _toggle_text(seam: Seam) -> str:
    switch = {"sm80": env.PATCH, "vision": env.VISION, "lab": env.LAB}[seam.overlay]
    return " and ".join((f"{switch.name}=1", *seam.when))


def _init_status(seams: Iterable[Seam], environ) -> None:
    for s in seams:
        if s.name in _status:
            continue
        try:
            on = s.enabled(environ)
        except env.EnvError as e:
            on, detail = False, str(e)
        else:
            detail = "" if on else "toggle off"
        _status[s.name] = SeamStatus(
            s.name, s.target, s.kind, s.upstream, _toggle_text(s), "pending" if on else "off", detail
        )


def status() -> list[dict]:
    """Every declared seam and what happened to it in this process."""
    with _lock:
        seams = all_seams()
        _init_status(seams, None)
        return [asdict(_status[s.name]) for s in seams]


def installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


def _refuse(seam_name: str, message: str) -> SeamRefusal:
    with _lock:
        st = _status.get(seam_name)
        if st is not None:
            st.state, st.detail = "refused", message
    seam = next((s for s in all_seams() if s.name == seam_name), None)
    overlay = seam.overlay if seam is not None else "sm80"
    off = {"vision": f"unset {env.VISION.name} to run without the Vision-Exp overlay",
           "lab": f"unset {env.LAB.name} to run without the lab's seams"}.get(
        overlay, f"set {env.PATCH.name}=0 to run SGLang natively (no SM80 datapath)")
    return SeamRefusal(
        f"dsv4-sm80 seam {seam_name}: {message}. The SM80 overlay only runs on SGLang "
        f"{env.SGLANG_VERSION} @ {env.SGLANG_COMMIT[:8]}; use that tree, or {off}."
    )


def verify_file(module_name: str, path: str | None, seams: list[Seam]) -> None:
    want = FINGERPRINTS.get(module_relpath(module_name))
    if path is None:
        raise _refuse(seams[0].name, f"{module_name} has no source file to fingerprint")
    got = file_hash(path)
    if got != want:
        raise _refuse(
            seams[0].name,
            f"{path} is not the 0.5.16 file (sha256 {got}, expected {want}); "
            f"targets {', '.join(s.target for s in seams)} may have changed",
        )


def _resolve(dotted: str) -> Callable:
    mod, _, attr = dotted.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _wrap(seam: Seam, original, replacement):
    if seam.kind == "replace":
        new = replacement
    elif seam.kind == "before":

        @functools.wraps(original)
        def new(*args, **kwargs):
            changed = replacement(*args, **kwargs)
            if changed is not None:
                args, kwargs = changed
            return original(*args, **kwargs)

    elif seam.kind == "after":

        @functools.wraps(original)
        def new(*args, **kwargs):
            result = original(*args, **kwargs)
            changed = replacement(result, *args, **kwargs)
            return result if changed is None else changed

    elif seam.kind == "around":

        @functools.wraps(original)
        def new(*args, **kwargs):
            return replacement(original, *args, **kwargs)

    else:  # validate_table() keeps this unreachable
        raise ValueError(seam.kind)
    try:
        setattr(new, MARK, seam.name)
        if new is not original:
            new.__wrapped__ = original
    except (AttributeError, TypeError):
        pass
    return new


_MISSING = object()


def _marks(fn) -> list:
    """The seam marks along a wrapper chain: several stages may wrap one target (the dense and MoE
    stages both route Fp8Config.get_quant_method), each exactly once."""
    out, seen = [], set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        mark = getattr(fn, MARK, None)
        if mark is None:
            break
        out.append(mark)
        fn = getattr(fn, "__wrapped__", None)
    return out


def _target(seam: Seam, module: types.ModuleType):
    """(the object holding the target attribute, its raw value) in an executed module; SeamRefusal if absent."""
    owner = module
    for part in seam.attr_path[:-1]:
        if not hasattr(owner, part):
            raise _refuse(seam.name, f"target {seam.target} not found ({part!r} missing)")
        owner = getattr(owner, part)
    attr = seam.attr_path[-1]
    raw = vars(owner).get(attr, _MISSING) if isinstance(owner, (type, types.ModuleType)) else _MISSING
    if raw is _MISSING:
        raise _refuse(seam.name, f"target {seam.target} not found ({attr!r} is not defined there)")
    return owner, raw


def bound(seam: Seam):
    """What the seam's target is now, in its imported module (a classmethod's or staticmethod's function)."""
    raw = _target(seam, sys.modules[seam.module])[1]
    return getattr(raw, "__func__", raw)


def apply_seam(seam: Seam, module: types.ModuleType) -> bool:
    """Apply one seam to its (already executed) target module. False if it was already applied."""
    with _lock:
        _init_status([seam], None)
        owner, raw = _target(seam, module)
        attr = seam.attr_path[-1]
        wrapper_type = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        original = raw.__func__ if wrapper_type else raw
        st = _status[seam.name]
        if seam.kind == "value":
            new = _resolve(seam.replacement)(original)
            if st.state == "applied" and original == new:
                return False  # exactly once
        else:
            if seam.name in _marks(original):
                return False  # exactly once (also when another stage's seam wraps it since)
            new = _wrap(seam, original, _resolve(seam.replacement))
        setattr(owner, attr, wrapper_type(new) if wrapper_type else new)
        if isinstance(owner, types.ModuleType) and callable(original) and seam.kind != "value":
            _repoint_copies(original, new, owner)
        st.state, st.detail = "applied", f"{module.__name__} ({getattr(module, '__file__', '?')})"
        st.applied_count += 1
        return True


def _repoint_copies(original, new, source_module) -> None:
    """`from X import Y` taken while X was executing (circular imports) still points at the
    original; re-point those bindings (the same service HookRegistry._propagate_patch gives)."""
    for mod in list(sys.modules.values()):
        if mod is source_module or not isinstance(mod, types.ModuleType):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for name, value in items:
            if value is original:
                setattr(mod, name, new)


def apply_module(module: types.ModuleType, seams: list[Seam]) -> None:
    for s in seams:
        apply_seam(s, module)


class _SeamLoader(importlib.abc.Loader):
    def __init__(self, inner, name: str, seams: list[Seam]):
        self._inner, self._name, self._seams = inner, name, seams

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        verify_file(self._name, getattr(module, "__file__", None), self._seams)
        self._inner.exec_module(module)
        apply_module(module, self._seams)

    def __getattr__(self, item):  # get_source, get_filename, is_package, ... (inspect, linecache)
        return getattr(self._inner, item)


class SeamFinder(importlib.abc.MetaPathFinder):
    def __init__(self, table: dict[str, list[Seam]]):
        self.table = table

    def find_spec(self, fullname, path, target=None):
        seams = self.table.get(fullname)
        if not seams:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            raise _refuse(seams[0].name, f"{fullname} is not loaded from a source file")
        spec.loader = _SeamLoader(spec.loader, fullname, seams)
        return spec


def install(environ=None) -> bool:
    """Arrange for every enabled seam to be applied when its module is imported. Idempotent.
    With nothing enabled (the patch off and no overlay switched on) this does nothing and returns False."""
    global _finder
    with _lock:
        seams = all_seams(environ)
        _init_status(seams, environ)
        enabled = [s for s in seams if s.enabled(environ)]
        if not enabled:
            return False
        if installed():
            return True
        table = by_module(enabled)
        _finder = SeamFinder(table)
        sys.meta_path.insert(0, _finder)
        for name, seams in table.items():  # modules imported before us (not from sitecustomize)
            module = sys.modules.get(name)
            if module is not None:
                verify_file(name, getattr(module, "__file__", None), seams)
                apply_module(module, seams)
        return True


def import_targets() -> list[dict]:
    """Import the module of every pending seam so it applies now (doctor --apply)."""
    pending = {st["name"] for st in status() if st["state"] == "pending"}
    for name in sorted({s.module for s in all_seams() if s.name in pending}):
        importlib.import_module(name)
    return status()
