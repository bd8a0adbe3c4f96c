import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PATCH = "ENABLE_SGLANG_DSV4_A100_PATCH"

# CPU machines (CI): Triton kernels run in Triton's interpreter. It must be on before triton is first
# imported anywhere in this process (SGLang imports it), because triton's own standard-library @jit
# functions (tl.cdiv, tl.max, tl.sigmoid, ...) are built at that import.
import torch  # noqa: E402

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Kernel tests run their kernels where they can: compiled on a GPU machine (the same tests then check
# the real kernels), in the interpreter on the CPU. References always run on the CPU.
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def dev(*tensors):
    """Tensors (None passes through) on the kernels' device; one tensor in, one out."""
    out = [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in tensors]
    return out[0] if len(out) == 1 else out


def load_script(relpath, name):
    """A repository script that is no package module (bench/*.py), imported as `name`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def clean_env(**overrides):
    """The test process's environment without any dsv4-sm80 / lab knobs, plus overrides."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ENABLE_SGLANG_DSV4", "SGLANG_DSV4", "DSV4_SM80", "SGLANG_OPT_"))}
    env.update({k: v for k, v in overrides.items() if v is not None})
    return env


def run_python(code, *, pythonpath=(), timeout=600, **env_overrides):
    """Run `code` in a fresh interpreter that has the repository first on PYTHONPATH (as the
    container's /sgl-workspace/platform is), so sitecustomize runs exactly as in production."""
    env = clean_env(**env_overrides)
    # entries the caller's PYTHONPATH already had stay after the repository (the GPU host's SGLang bundle lives
    # in /tmp/site on PYTHONPATH, not in the interpreter's site-packages)
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != REPO]
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, REPO, *kept])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def last_json(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def unit_ckpt(tmp_path_factory):
    """A tiny official-format checkpoint (the `unit` preset), generated once per session."""
    from dsv4_sm80.tiny.generate import PRESETS, generate, tiny_config

    out = str(tmp_path_factory.mktemp("unit-ckpt"))
    generate(out, tiny_config(PRESETS["unit"]), seed=0, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def unit_vision_ckpt(tmp_path_factory):
    from dataclasses import replace

    from dsv4_sm80.tiny.generate import PRESETS, generate, tiny_config

    out = str(tmp_path_factory.mktemp("unit-vision-ckpt"))
    size = replace(PRESETS["unit"], vocab=129280)
    generate(out, tiny_config(size, vision=True), seed=0, log=lambda *_: None)
    return out


def _sglang_version():
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return None
    from dsv4_sm80 import upstream

    return upstream.read_version(upstream.locate_sglang())


def pytest_report_header(config):
    v = _sglang_version()
    if v is None:
        return "dsv4-sm80: sglang is NOT installed - every test marked `sglang` will SKIP (CI installs 0.5.16)"
    return f"dsv4-sm80: testing against the real sglang {v}"


def pytest_sessionstart(session):
    # CI sets this: there a missing SGLang is an error, never a quiet skip.
    if os.environ.get("DSV4_SM80_REQUIRE_SGLANG") == "1" and _sglang_version() != "0.5.16":
        pytest.exit(f"DSV4_SM80_REQUIRE_SGLANG=1 but sglang is {_sglang_version()!r}, not 0.5.16", returncode=3)


def nvcc_home():
    """A CUDA toolkit with nvcc: CUDA_HOME, the one on PATH, or the pip wheel SGLang's install brings."""
    for home in (os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(shutil.which("nvcc") or "/x/x"))):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in sorted(os.listdir(base)):
                if os.path.isfile(os.path.join(base, sub, "bin", "nvcc")):
                    return os.path.join(base, sub)
    except ImportError:
        pass
    return None
