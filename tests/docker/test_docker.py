"""The derived image, built from the real docker/Dockerfile with docker/build.sh on a stand-in base.

No registry is reachable, so the tests make a stand-in for the official SGLang v0.5.16 image: a Debian
rootfs (debootstrap, python3 + git) imported with `docker import`, with SGLang 0.5.16's Python tree (the
installed sglang==0.5.16 package, which the gate fingerprints) at /sgl-workspace/sglang/python. It has no
git checkout, so the gate vouches for the commit by fingerprints, as build.sh records in a label.

These tests are skipped only when dockerd cannot start here (.ci/run starts it), and then loudly.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

STANDIN = "dsv4-sm80-test/sglang-standin:v0.5.16"
PREVIEW = "dsv4-sm80-test/sglang-standin:v0.5.17-dev"
BUILT = "dsv4-sm80-test/overlay:test"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsv4-sm80-standin")
PY = "PYTHONPATH=/sgl-workspace/platform:/sgl-workspace/sm80-patch:/sgl-workspace/sglang/python"


def sh(*cmd, check=True, timeout=900, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def docker_ok() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def docker():
    if not docker_ok():
        msg = ("DOCKER TESTS SKIPPED: dockerd is not running or cannot start on this machine; the derived image "
               "is NOT tested (.ci/run starts dockerd)")
        print("\n" + "!" * 100 + "\n" + msg + "\n" + "!" * 100, file=sys.stderr)
        pytest.skip(msg)
    return "docker"


def _sglang_tree() -> str:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    assert spec and spec.origin, "the tests need the installed sglang==0.5.16 package"
    return os.path.dirname(spec.origin)


def _rootfs_tar() -> str:
    tar = os.path.join(CACHE, "bookworm-python3.tar")
    if os.path.isfile(tar):
        return tar
    os.makedirs(CACHE, exist_ok=True)
    root = os.path.join(CACHE, "rootfs")
    shutil.rmtree(root, ignore_errors=True)
    sh("debootstrap", "--variant=minbase", "--include=python3,git", "bookworm", root, "http://deb.debian.org/debian",
       timeout=1200)
    sh("tar", "-C", root, "-cf", tar + ".part", ".")
    os.replace(tar + ".part", tar)
    shutil.rmtree(root, ignore_errors=True)
    return tar


@pytest.fixture(scope="module")
def standin(docker, tmp_path_factory):
    """The stand-in base image (cached across runs by its tag)."""
    if sh("docker", "image", "inspect", STANDIN, check=False).returncode == 0:
        return STANDIN
    sh("docker", "import", _rootfs_tar(), "dsv4-sm80-test/rootfs:bookworm")
    ctx = tmp_path_factory.mktemp("standin")
    shutil.copytree(_sglang_tree(), ctx / "sglang", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (ctx / "Dockerfile").write_text(
        "FROM dsv4-sm80-test/rootfs:bookworm\n"
        "COPY sglang /sgl-workspace/sglang/python/sglang\n"
        'CMD ["python3"]\n')
    sh("docker", "build", "-t", STANDIN, str(ctx))
    return STANDIN


NO_PREBUILD = dict(os.environ, PREBUILD_JIT="0")  # the stand-in has no CUDA toolkit to build SGLang's JIT modules


@pytest.fixture(scope="module")
def built(standin):
    r = sh(os.path.join(REPO, "docker", "build.sh"), standin, BUILT, cwd=REPO, env=NO_PREBUILD)
    return BUILT, r


def test_the_jit_prebuild_fails_the_build_loudly_on_a_base_without_the_cuda_toolkit(standin):
    """By default the Dockerfile compiles SGLang's JIT modules for sm_80 (python -m dsv4_sm80 prebuild-jit); on a
    base without nvcc that step refuses by name and the image is not built (tests/unit/test_jit_prebuild.py builds the
    modules themselves, for sm_80, on a machine with the toolkit)."""
    tag = "dsv4-sm80-test/overlay:prebuild"
    r = sh(os.path.join(REPO, "docker", "build.sh"), standin, tag, cwd=REPO, check=False)
    assert r.returncode != 0
    assert "prebuild-jit: FAIL jit.compiler: found no nvcc at /usr/local/cuda/bin/nvcc" in r.stderr, r.stderr[-3000:]
    assert sh("docker", "image", "inspect", tag, check=False).returncode != 0


def image_id(ref):
    return sh("docker", "image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()


def test_build_labels_and_pins_the_base(built, standin):
    tag, r = built
    assert r.stdout.strip() == tag
    assert "PASS sglang.version: 0.5.16" in r.stderr and "PASS sglang.fingerprint" in r.stderr
    labels = json.loads(sh("docker", "image", "inspect", "--format", "{{json .Config.Labels}}", tag).stdout)
    pyproject = open(os.path.join(REPO, "pyproject.toml"))
    version = [line.split('"')[1] for line in pyproject if line.startswith("version")][0]
    assert labels["org.dsv4-sm80.version"] == version
    assert labels["org.dsv4-sm80.base-image-id"] == image_id(standin)
    assert labels["org.dsv4-sm80.sglang-commit"] == "fdebc938f7f4d16fe6b9f55dcd9a767cf0899ea1"
    assert labels["org.dsv4-sm80.sglang-verified-by"] == "fingerprint"


def test_env_and_pythonpath_order(built):
    env = json.loads(sh("docker", "image", "inspect", "--format", "{{json .Config.Env}}", built[0]).stdout)
    assert PY in env
    for kv in ("ENABLE_SGLANG_DSV4_A100_PATCH=1", "SGLANG_DSV4_A100_INT8_INDEXER=1",
               "SGLANG_DSV4_MXFP4_MOE_BACKEND=mxfp4_int8", "SGLANG_ROOT=/sgl-workspace/sglang"):
        assert kv in env, (kv, env)
    # what a process in the container sees: the overlay first, SGLang's tree last, sitecustomize active
    r = sh("docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", built[0], "-c",
           "import sys, sitecustomize as s; print([p for p in sys.path if p.startswith('/sgl-workspace')]); "
           "print(s.__file__, s.DSV4_SM80_STATE)")
    paths, site = r.stdout.strip().splitlines()
    assert paths == str(["/sgl-workspace/platform", "/sgl-workspace/sm80-patch", "/sgl-workspace/sglang/python"])
    assert site.startswith("/sgl-workspace/platform/sitecustomize.py")


def test_entrypoint_gate_fails_fast_without_gpus(built):
    r = sh("docker", "run", "--rm", "--network", "none", built[0], "--model-path", "/tmp", "--port", "30000",
           check=False, timeout=120)
    assert r.returncode != 0
    assert "FAIL gpu.count: found 0 visible GPUs" in r.stdout, r.stdout + r.stderr
    assert "PASS sglang.version: 0.5.16" in r.stdout and "PASS patch.active" in r.stdout
    assert "serve:" not in r.stdout  # SGLang's launch_server was never started


def test_doctor_prints_the_report(built):
    r = sh("docker", "run", "--rm", "--network", "none", built[0], "doctor", check=False, timeout=120)
    assert "== gate" in r.stdout and "PASS sglang.fingerprint" in r.stdout and "FAIL gpu.count" in r.stdout
    assert "== seams" in r.stdout or "seams:" in r.stdout
    r = sh("docker", "run", "--rm", "--network", "none", built[0], "doctor", "--json", check=False, timeout=120)
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and any(c["check"] == "gpu.count" and c["status"] == "fail" for c in doc["checks"])


def test_the_image_holds_no_lab_code(built):
    """The laboratory (dsv4_lab: replays, tripwire, beds, the GPU suite and its scripts) and the tests never ship:
    nothing of them anywhere in the image, and with the lab switch on the overlay refuses rather than run without the
    lab's seams."""
    r = sh("docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", built[0], "-c",
           "find / -xdev \\( -name dsv4_lab -o -name 'test_*.py' -path '*dsv4*' -o -name accuracy.sh "
           "-o -name jit-seed \\) -print; "
           "ls /sgl-workspace/sm80-patch; ls /sgl-workspace/platform")
    assert all(name not in r.stdout for name in ("dsv4_lab", "accuracy.sh", "jit-seed")), r.stdout
    assert sorted(r.stdout.split()) == sorted(["compat_check.py", "entrypoint.sh", "sitecustomize.py", "dsv4_sm80",
                                               "vision_backport"]), r.stdout
    r = sh("docker", "run", "--rm", "--network", "none", "-e", "DSV4_SM80_LAB=1", "--entrypoint", "python3", built[0],
           "-c", "import dsv4_sm80.apply as a; a.lab_seams()", check=False, timeout=120)
    assert r.returncode != 0 and "DSV4_SM80_LAB=1 but the lab package cannot be imported" in r.stdout + r.stderr


def _tree_digest(image):
    r = sh("docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c",
           "cd /sgl-workspace/sglang && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum")
    return hashlib.sha256(r.stdout.encode()).hexdigest(), len(r.stdout.splitlines())


def test_sglang_tree_is_byte_identical_to_the_base(built, standin):
    base, n = _tree_digest(standin)
    assert n > 1000  # the whole Python tree is there
    assert _tree_digest(built[0]) == (base, n)


def test_refuses_the_0517_dev_preview(standin, tmp_path):
    ctx = tmp_path / "preview"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        f"FROM {standin}\n"
        "RUN sed -i 's/0.5.16/0.5.17.dev20261101/' /sgl-workspace/sglang/python/sglang/_version.py\n")
    sh("docker", "build", "-t", PREVIEW, str(ctx))
    r = sh(os.path.join(REPO, "docker", "build.sh"), PREVIEW, "dsv4-sm80-test/overlay:preview", cwd=REPO, check=False)
    assert r.returncode == 1
    assert "FAIL sglang.version: found 0.5.17.dev20261101 (the 0.5.17 dev-preview)" in r.stderr, r.stderr
    assert "FAIL base.sglang" in r.stderr
    assert sh("docker", "image", "inspect", "dsv4-sm80-test/overlay:preview", check=False).returncode != 0


def test_image_id_assertion_trips_when_the_base_changes_during_the_build(standin, tmp_path):
    moving = "dsv4-sm80-test/sglang-standin:moving"
    sh("docker", "tag", standin, moving)
    other = tmp_path / "other"
    other.mkdir()
    (other / "Dockerfile").write_text(f"FROM {standin}\nRUN echo changed > /etc/dsv4-changed\n")
    hook = f"docker build -q -t {moving} {other}"  # the tag now names another image, mid-build
    r = sh(os.path.join(REPO, "docker", "build.sh"), moving, "dsv4-sm80-test/overlay:moving", cwd=REPO, check=False,
           env=dict(NO_PREBUILD, DSV4_SM80_BUILD_HOOK=hook))
    assert r.returncode == 1
    assert "FAIL base.unchanged: the base dsv4-sm80-test/sglang-standin:moving changed during the build" in r.stderr
    assert sh("docker", "image", "inspect", "dsv4-sm80-test/overlay:moving", check=False).returncode != 0
