"""The gate's decision for each red line, from injected facts (and real checkpoint files).

Each bad input must fail exactly the check it violates, with a one-line message naming what was
found, what was expected and what to do.
"""

import json
import os
import shutil
from types import SimpleNamespace

import pytest

from dsv4_sm80 import gate as cc
from dsv4_sm80.checkpoint.safetensors_io import read_header, write_shard
from dsv4_sm80.gate import Facts, GpuFacts, PatchFacts, SGLangFacts

A800 = [{"index": i, "name": "NVIDIA A800-SXM4-80GB", "cc": "8.0", "memory_gib": 79.3} for i in range(4)]
H200 = [{"index": 0, "name": "NVIDIA H200", "cc": "9.0", "memory_gib": 139.8}]


def good_sglang(**kw):
    return SGLangFacts(**{"location": "/usr/lib/python3/dist-packages/sglang", "version": "0.5.16", **kw})


def good_patch(**kw):
    from dsv4_sm80 import env

    return PatchFacts(**{"env_value": "1", "sitecustomize": "/sgl-workspace/platform/sitecustomize.py",
                         "ours": True, "hook_installed": True,
                         "knobs": {d.name: d.value for d in env.IMPORT_TIME_DEFAULTS}, **kw})


def facts(model=None, sglang=None, gpus=None, patch=None, lab=None):
    return Facts(sglang=sglang or good_sglang(), gpus=gpus or GpuFacts(devices=list(A800)),
                 patch=patch or good_patch(), model=cc.collect_model(model), lab=lab or {})


def failed(f):
    out = {x.check: x for x in cc.failures(cc.evaluate(f))}
    for x in out.values():
        assert x.found and x.expected and x.fix, x
        assert "\n" not in x.line()
    return out


def assert_only(f, check, *phrases):
    bad = failed(f)
    assert list(bad) == [check], [b.line() for b in bad.values()]
    line = bad[check].line()
    for p in phrases:
        assert p in line, line
    return line


# --- the good cases -------------------------------------------------------------------------------

def test_good_checkpoint_passes(unit_ckpt):
    assert failed(facts(unit_ckpt)) == {}


def test_good_vision_checkpoint_passes(unit_vision_ckpt):
    findings = cc.evaluate(facts(unit_vision_ckpt))
    assert not cc.failures(findings)
    assert next(f for f in findings if f.check == "model.vision").status == "pass"


def test_lab_overrides_admit_the_h200_and_are_loud(capsys):
    lab = {"DSV4_SM80_LAB_GPU_COUNT": "1", "DSV4_SM80_LAB_CC": "9.0"}
    assert failed(facts(gpus=GpuFacts(devices=H200), lab=lab)) == {}
    from dsv4_sm80 import env

    banner = env.lab_banner(lab)
    assert "LAB MODE" in banner and "DSV4_SM80_LAB_CC=9.0" in banner and "not A800 numbers" in banner
    assert env.lab_banner({}) is None


def test_report_json_and_text(unit_ckpt):
    f = facts(unit_ckpt, gpus=GpuFacts(error="libcuda.so.1 cannot be loaded"))
    findings = cc.evaluate(f)
    doc = json.loads(cc.report(f, findings, as_json=True))
    assert doc["ok"] is False
    assert [c["check"] for c in doc["checks"] if c["status"] == "fail"] == ["gpu.count"]
    text = cc.report(f, findings)
    assert text.splitlines()[-1] == "gate: REFUSED, 1 failed (gpu.count)"


# --- SGLang red lines -----------------------------------------------------------------------------

def test_no_sglang():
    assert_only(facts(sglang=SGLangFacts()), "sglang.installed", "no importable sglang", "0.5.16")


def test_wrong_version():
    assert_only(facts(sglang=good_sglang(version="0.5.15")), "sglang.version", "found 0.5.15", "0.5.16 @ fdebc938")


def test_dev_preview_refused():
    line = assert_only(facts(sglang=good_sglang(version="0.5.17.dev0")), "sglang.version", "0.5.17 dev-preview")
    assert "never be mixed" in line


def test_wrong_commit():
    sg = good_sglang(sglang_root="/sgl-workspace/sglang", under_root=True, git_commit="1c0019da" + "0" * 32,
                     git_dirty=[])
    assert_only(facts(sglang=sg), "sglang.commit", "git HEAD 1c0019da", "fdebc938f7f4")


def test_touched_tree():
    from dsv4_sm80 import env

    sg = good_sglang(sglang_root="/sgl-workspace/sglang", under_root=True, git_commit=env.SGLANG_COMMIT,
                     git_dirty=["python/sglang/srt/models/deepseek_v4.py"])
    assert_only(facts(sglang=sg), "sglang.tree_clean", "1 modified files", "deepseek_v4.py", "git checkout")


def test_sglang_not_from_root():
    from dsv4_sm80 import env

    sg = good_sglang(sglang_root="/sgl-workspace/sglang", under_root=False, git_commit=env.SGLANG_COMMIT, git_dirty=[])
    assert_only(facts(sglang=sg), "sglang.location", "SGLANG_ROOT")


def test_fingerprint_mismatch():
    sg = good_sglang(fingerprint_mismatch={"srt/models/deepseek_v4.py": "sha256 abc, expected y_fz"})
    assert_only(facts(sglang=sg), "sglang.fingerprint", "srt/models/deepseek_v4.py", "untouched v0.5.16")


# --- GPU red lines --------------------------------------------------------------------------------

def test_no_gpu():
    assert_only(facts(gpus=GpuFacts(error="libcuda.so.1 cannot be loaded: no NVIDIA driver")),
                       "gpu.count", "found 0 visible GPUs", "no NVIDIA driver", "expected exactly 4")


def test_eight_gpus():
    eight = [dict(A800[0], index=i) for i in range(8)]
    assert_only(facts(gpus=GpuFacts(devices=eight)), "gpu.count", "found 8 visible GPUs", "CUDA_VISIBLE_DEVICES")


def test_hopper_refused_without_lab():
    four_h = [dict(H200[0], index=i) for i in range(4)]
    assert_only(facts(gpus=GpuFacts(devices=four_h)), "gpu.capability", "compute capability 9.0", "every GPU 8.0",
                "ENABLE_SGLANG_DSV4_A100_PATCH=0")


def test_40gb_cards_refused():
    small = [dict(d, name="NVIDIA A100-SXM4-40GB", memory_gib=39.4) for d in A800]
    assert_only(facts(gpus=GpuFacts(devices=small)), "gpu.memory", "39.4 GiB", "80 GB")


def test_bad_lab_override():
    assert_only(facts(lab={"DSV4_SM80_LAB_GPU_COUNT": "two"}), "gpu.count", "'two'", "positive integer")


# --- patch ------------------------------------------------------------------------------------------

def test_patch_off():
    assert_only(facts(patch=good_patch(env_value="0")), "patch.active", "ENABLE_SGLANG_DSV4_A100_PATCH='0'",
                "export ENABLE_SGLANG_DSV4_A100_PATCH=1")


def test_foreign_sitecustomize():
    p = good_patch(ours=False, sitecustomize="/usr/lib/python3.12/sitecustomize.py")
    assert_only(facts(patch=p), "patch.active", "not dsv4-sm80's", "/sgl-workspace/platform")


def test_patch_failed_to_install():
    p = good_patch(hook_installed=False, error="ModuleNotFoundError: No module named 'dsv4_sm80'")
    assert_only(facts(patch=p), "patch.active", "did not install", "dsv4_sm80")


def test_sm90_only_sglang_knob_refused():
    from dsv4_sm80 import env

    knobs = {d.name: d.value for d in env.IMPORT_TIME_DEFAULTS}
    knobs["SGLANG_OPT_FP8_WO_A_GEMM"] = "1"
    assert_only(facts(patch=good_patch(knobs=knobs)), "patch.sglang_knobs", "SGLANG_OPT_FP8_WO_A_GEMM='1'",
                "DeepGEMM", "unset SGLANG_OPT_FP8_WO_A_GEMM")


# --- model files ------------------------------------------------------------------------------------

def clone(src, dst):
    """Copy a checkpoint cheaply (hard links); files that a test rewrites are replaced, not edited."""
    shutil.copytree(src, dst, copy_function=os.link)
    for f in ("config.json", "model.safetensors.index.json"):
        os.unlink(os.path.join(dst, f))
        shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return str(dst)


def rewrite(ckpt, fn, only=None):
    """Rewrite every shard through fn(name, dtype, shape, data) -> [(name, dtype, shape, data), ...];
    then rebuild the index from the headers."""
    wm = {}
    for f in sorted(x for x in os.listdir(ckpt) if x.endswith(".safetensors")):
        path = os.path.join(ckpt, f)
        h = read_header(path)
        if only is None or f in only:
            blob = open(path, "rb").read()
            tensors = []
            for name, t in h.tensors.items():
                b, e = t["data_offsets"]
                tensors += fn(name, t["dtype"], tuple(t["shape"]), blob[8 + h.header_len + b: 8 + h.header_len + e])
            os.unlink(path)
            write_shard(path, tensors)
            h = read_header(path)
        wm.update({n: f for n in h.tensors})
    index = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))
    index["weight_map"] = wm
    json.dump(index, open(os.path.join(ckpt, "model.safetensors.index.json"), "w"))


def edit_config(ckpt, **changes):
    p = os.path.join(ckpt, "config.json")
    cfg = json.load(open(p))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(p, "w"))


def test_model_path_missing(tmp_path):
    assert_only(facts(str(tmp_path / "nope")), "model.path", "does not exist, not a directory")


def test_wrong_architecture(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    edit_config(ck, architectures=["DeepseekV3ForCausalLM"])
    assert_only(facts(ck), "model.architecture", "DeepseekV3ForCausalLM", "['DeepseekV4ForCausalLM']")


def test_v41_model_type(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    edit_config(ck, model_type="deepseek_v41")
    assert_only(facts(ck), "model.model_type", "'deepseek_v41'", "V4.1")


def test_quantization_config_removed(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    edit_config(ck, quantization_config=None)
    assert_only(facts(ck), "model.quantization_config", "quant_method", "altered")


def test_index_missing(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    os.unlink(os.path.join(ck, "model.safetensors.index.json"))
    assert_only(facts(ck), "model.index", "model.safetensors.index.json: missing")


def test_missing_shard(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    os.unlink(os.path.join(ck, "model-00004-of-00010.safetensors"))
    assert_only(facts(ck), "model.shards", "model-00004-of-00010.safetensors: missing", "re-download")


def test_truncated_shard(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    p = os.path.join(ck, "model-00007-of-00010.safetensors")
    data = open(p, "rb").read()
    os.unlink(p)
    open(p, "wb").write(data[:-4096])
    assert_only(facts(ck), "model.shards", "model-00007-of-00010.safetensors: truncated")


def test_converted_bf16_linears_refused(unit_ckpt, tmp_path):
    """The community converter's output: dense FP8 linears as BF16, their .scale dropped."""
    import torch

    ck = clone(unit_ckpt, tmp_path / "c")

    def to_bf16(name, dtype, shape, data):
        if dtype == "F8_E4M3":
            w = torch.frombuffer(bytearray(data), dtype=torch.float8_e4m3fn).view(shape).to(torch.bfloat16)
            return [(name, "BF16", shape, w.view(torch.uint8).numpy().tobytes())]
        if name.endswith(".scale") and ".experts." not in name:
            return []
        return [(name, dtype, shape, data)]

    rewrite(ck, to_bf16)
    line = assert_only(facts(ck), "model.dense_fp8", "stored as BF16 without their .scale", "a converted checkpoint",
                       "never needs converted weights")
    assert "layers.0.attn.wq_a.weight BF16" in line


def test_retyped_experts_refused(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")

    def to_fp8(name, dtype, shape, data):
        if ".experts." in name and name.endswith(".weight"):
            return [(name, "F8_E4M3", (shape[0], shape[1] * 2), data + data)]
        return [(name, dtype, shape, data)]

    rewrite(ck, to_fp8, only={"model-00003-of-00010.safetensors"})
    assert_only(facts(ck), "model.experts", "re-typed", "layers.1.ffn.experts.0.w1.weight F8_E4M3", "I8 [out, in/2]")


def test_hf_style_names_refused(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")

    def hf(name, dtype, shape, data):
        if name.startswith("layers.0."):
            name = "model." + name.replace(".scale", ".weight_scale_inv")
        return [(name, dtype, shape, data)]

    rewrite(ck, hf, only={"model-00002-of-00010.safetensors"})
    bad = failed(facts(ck))
    assert "HF-style names: a converted checkpoint" in bad["model.keys"].line()
    assert set(bad) <= {"model.keys", "model.dense_fp8", "model.experts"}


def test_vision_tensors_dropped(unit_vision_ckpt, tmp_path):
    """What the text-only converter does to Vision-Exp: vision tensors gone, config unchanged."""
    ck = clone(unit_vision_ckpt, tmp_path / "c")
    rewrite(ck, lambda n, d, s, b: [] if n.startswith(("vision.", "aligner.")) else [(n, d, s, b)])
    assert_only(facts(ck), "model.vision", "vision tensors missing", "text-only converter")


def test_vision_tensors_altered(unit_vision_ckpt, tmp_path):
    ck = clone(unit_vision_ckpt, tmp_path / "c")

    def to_f16(name, dtype, shape, data):
        if name == "aligner.w2.weight":
            return [(name, "F16", shape, data)]
        return [(name, dtype, shape, data)]

    rewrite(ck, to_f16)
    assert_only(facts(ck), "model.vision", "1 vision tensors altered", "aligner.w2.weight F16")


def test_vision_tensors_without_vision_config(unit_vision_ckpt, tmp_path):
    ck = clone(unit_vision_ckpt, tmp_path / "c")
    edit_config(ck, **{k: None for k in json.load(open(os.path.join(ck, "config.json"))) if k.startswith("vision_")})
    line = failed(facts(ck))["model.vision"].line()
    assert "no vision_* fields in config.json" in line


# --- the real collectors ------------------------------------------------------------------------------

def test_git_head_reader(tmp_path):
    from dsv4_sm80.upstream import read_git_head

    sha = "fdebc938f7f4d16fe6b9f55dcd9a767cf0899ea1"
    g = tmp_path / "detached" / ".git"
    g.mkdir(parents=True)
    (g / "HEAD").write_text(sha + "\n")
    assert read_git_head(str(tmp_path / "detached")) == sha
    g = tmp_path / "packed" / ".git"
    g.mkdir(parents=True)
    (g / "HEAD").write_text("ref: refs/heads/main\n")
    (g / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/main\n")
    assert read_git_head(str(tmp_path / "packed")) == sha
    (g / "refs" / "heads").mkdir(parents=True)
    (g / "refs" / "heads" / "main").write_text("1" * 40 + "\n")
    assert read_git_head(str(tmp_path / "packed")) == "1" * 40


def test_collect_git_facts(tmp_path, monkeypatch):
    """A git tree at SGLANG_ROOT is read (commit and cleanliness) when sglang is imported from it."""
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git binary not installed: the gate then reads HEAD without it (tested above)")
    root = tmp_path / "sglang"
    (root / "python" / "sglang").mkdir(parents=True)
    (root / "python" / "sglang" / "__init__.py").write_text("")
    (root / "python" / "sglang" / "_version.py").write_text("__version__ = version = '0.5.16'\n")

    def run(*a):
        subprocess.run(["git", "-C", str(root), *a], check=True, capture_output=True)

    run("init", "-q")
    run("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    from dsv4_sm80 import upstream

    monkeypatch.setattr(upstream, "locate_sglang", lambda: str(root / "python" / "sglang"))
    f = cc.collect_sglang({"SGLANG_ROOT": str(root)})
    assert f.under_root and f.version == "0.5.16" and len(f.git_commit) == 40 and f.git_dirty == []
    (root / "python" / "sglang" / "__init__.py").write_text("# edited\n")
    f = cc.collect_sglang({"SGLANG_ROOT": str(root)})
    assert f.git_dirty == ["python/sglang/__init__.py"]
    bad = failed(Facts(f, GpuFacts(devices=list(A800)), good_patch(), cc.collect_model(None)))
    assert {"sglang.commit", "sglang.tree_clean", "sglang.fingerprint"} <= set(bad)


@pytest.mark.sglang
def test_collect_real_sglang():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    f = cc.collect_sglang({"SGLANG_ROOT": "/nonexistent"})
    assert f.version == "0.5.16" and f.fingerprint_mismatch == {}
    assert [x.status for x in cc.check_sglang(f)] == ["pass", "pass", "pass"]


def test_gpu_probe_runs():
    g = cc.collect_gpus()
    assert g.error or g.devices  # on the CPU CI machine: the driver-missing error, never an exception
    if not g.devices:
        assert "libcuda" in g.error or "no CUDA device" in g.error


def test_version_read_from_files_without_metadata(tmp_path):
    """The official image's tree may have no importable distribution metadata: the version comes from
    sglang/_version.py as vcs-versioning writes it (a chained assignment), and from simpler forms."""
    from dsv4_sm80.upstream import read_version

    for text, want in (("__version__ = version = '0.5.16'\n__version_tuple__ = (0, 5, 16)\n", "0.5.16"),
                       ('__version__ = "0.5.17.dev20261101"\n', "0.5.17.dev20261101"),
                       ("version: str = '0.5.16'\n", "0.5.16")):
        (tmp_path / "_version.py").write_text("# generated\nfrom __future__ import annotations\n" + text)
        assert read_version(str(tmp_path)) == want


def test_nextn_on_a_dspark_checkpoint_refused(unit_ckpt):
    """NEXTN/EAGLE need the original release's MTP e_proj/h_proj; the 0731-format checkpoint carries a
    DSPARK draft, so they are refused with the fix; DSPARK and no speculation pass."""
    m = cc.collect_model(unit_ckpt)
    for algo in ("NEXTN", "EAGLE", "eagle3"):
        f = cc.check_speculative(algo, m)
        assert f.status == "fail" and f.line().startswith(
            f"FAIL speculative.draft: found --speculative-algorithm {algo.upper()} on a checkpoint without "
            "mtp.*.e_proj / h_proj (it carries a DSPARK draft"), f.line()
        assert f.line().endswith("fix: use --speculative-algorithm DSPARK"), f.line()
    assert cc.check_speculative("DSPARK", m).status == "pass"
    assert cc.check_speculative(None, m).status == "pass"
    m.index.value = {"weight_map": dict(m.weight_map, **{"mtp.0.e_proj.weight": "x", "mtp.0.h_proj.weight": "x"})}
    assert cc.check_speculative("NEXTN", m).status == "pass"  # the original V4-Flash layout


def test_engine_with_nextn_is_refused_at_launch(unit_ckpt):
    """Through SGLang's own launch (the launch.gate seam), before any scheduler process starts. (SGLang
    maps NEXTN to EAGLE on a GPU host before launch; the CPU host here is given EAGLE directly.)"""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from conftest import run_python

    code = f"""
import sglang
try:
    sglang.Engine(model_path={unit_ckpt!r}, skip_tokenizer_init=True, device="cpu", speculative_algorithm="EAGLE",
                  speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)
except BaseException as e:
    print(type(e).__name__, str(e))
"""
    res = run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", timeout=300)
    assert "FAIL speculative.draft: found --speculative-algorithm EAGLE on a checkpoint without" in res.stdout, \
        res.stdout[-3000:] + res.stderr[-3000:]


def test_unverified_modes_are_refused_and_off_by_default(unit_ckpt):
    """SGLang's own defaults for a DSV4 checkpoint leave every unverified mode off (so a default launch
    passes); each one set is refused naming its flag, and several are named together."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=unit_ckpt, skip_tokenizer_init=True, device="cpu")
    assert cc.check_modes(args).status == "pass", cc.check_modes(args).line()
    for attr, flag, _ in cc.UNVERIFIED_MODES:
        assert hasattr(args, attr), attr  # the 0.5.16 attribute names
        value = "prefill" if attr == "disaggregation_mode" else 2 if attr in cc.COUNT_MODES else True
        f = cc.check_modes(SimpleNamespace(**{attr: value}))
        assert f.status == "fail" and f.line().startswith(f"FAIL server.modes: found {flag}"), f.line()
        assert f.fix == f"drop {flag}"
        if attr in cc.COUNT_MODES:
            assert f.found.startswith(f"{flag} 2 (") and cc.check_modes(SimpleNamespace(**{attr: 1})).status == "pass"
    assert cc.check_modes(SimpleNamespace(lora_paths=["a=/x"])).found.startswith("--lora-paths (LoRA")
    assert cc.check_modes(SimpleNamespace(lora_paths=[], enable_lora=None)).status == "pass"
    f = cc.check_modes(SimpleNamespace(enable_dp_attention=True, disaggregation_mode="decode"))
    assert "--enable-dp-attention (" in f.found and "--disaggregation-mode decode (" in f.found
    assert f.fix == "drop --enable-dp-attention, --disaggregation-mode"


def test_engine_with_dp_attention_is_refused_at_launch(unit_ckpt):
    """Through SGLang's own launch: the refusal names server.modes (beside the CPU host's own gate failures)."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from conftest import run_python

    code = f"""
import sglang
try:
    sglang.Engine(model_path={unit_ckpt!r}, skip_tokenizer_init=True, device="cpu", enable_dp_attention=True,
                  tp_size=2, dp_size=2)
except BaseException as e:
    print(type(e).__name__, str(e))
"""
    res = run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", timeout=300)
    assert "FAIL server.modes: found --enable-dp-attention (data-parallel attention" in res.stdout, \
        res.stdout[-3000:] + res.stderr[-3000:]


def test_bind_rule():
    assert cc.check_bind(None, False).status == "pass"  # SGLang's default host is 127.0.0.1
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.1.1"):
        assert cc.check_bind(host, False).status == "pass", host
    f = cc.check_bind("0.0.0.0", False, environ={})
    assert f.status == "fail" and "DSV4_SM80_ALLOW_OPEN_BIND=1" in f.fix
    assert cc.check_bind("0.0.0.0", True, environ={}).status == "pass"
    opt_out = cc.check_bind("192.168.1.5", False, environ={"DSV4_SM80_ALLOW_OPEN_BIND": "1"})
    assert opt_out.status == "pass" and "WITHOUT an API key" in opt_out.found


def test_launch_server_path_refuses_an_open_bind(unit_ckpt):
    """Also without `serve` (PYTHONPATH injection, `python -m sglang.launch_server --host 0.0.0.0`): the
    launch.gate seam applies the same rule before any scheduler starts; the key is never echoed."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    from conftest import run_python

    code = f"""
import sglang
for kw in (dict(host="0.0.0.0"), dict(host="0.0.0.0", api_key="sk-launch-secret")):
    try:
        sglang.Engine(model_path={unit_ckpt!r}, skip_tokenizer_init=True, device="cpu", **kw)
    except BaseException as e:
        print("REFUSED", "server.bind" in str(e), "FAIL server.bind: found --host 0.0.0.0 (not loopback)" in str(e))
"""
    res = run_python(code, ENABLE_SGLANG_DSV4_A100_PATCH="1", timeout=300)
    assert res.stdout.count("REFUSED") == 2, res.stdout + res.stderr[-3000:]
    assert "REFUSED True True" in res.stdout and "REFUSED False False" in res.stdout
    assert "sk-launch-secret" not in res.stdout + res.stderr


# --- dsv4-sm80's own env knobs -------------------------------------------------------------------

def test_knob_outside_its_values_refused():
    f = facts()
    f.knobs = {"SGLANG_DSV4_A100_INT8_INDEXER": "0"}
    assert_only(f, "env.knobs", "SGLANG_DSV4_A100_INT8_INDEXER='0'", "only indexer cache", "unset it")
    f.knobs = {"SGLANG_DSV4_MXFP4_MOE_BACKEND": "mxfp4-int8"}
    assert_only(f, "env.knobs", "'mxfp4-int8'", "one of mxfp4_int8, marlin")
    f.knobs = {"SGLANG_DSV4_MXFP4_MOE_BACKEND": "marlin", "SGLANG_DSV4_A100_INT8_INDEXER": "1"}
    assert {x.check: x.status for x in cc.evaluate(f)}["env.knobs"] == "pass"


def test_knobs_collected_from_the_launch_environment():
    assert cc.collect(patch_environ={"SGLANG_DSV4_A100_DENSE": "fp8_marlin", "PATH": "/bin"}).knobs == \
        {"SGLANG_DSV4_A100_DENSE": "fp8_marlin"}


# --- every input class the loader meets: one FAIL line naming the check, never a traceback ------------

def raw_shard(path, header, payload=b""):
    """A shard with exactly this header (an object to JSON-encode, or raw bytes) and payload."""
    import struct

    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    if os.path.lexists(path):
        os.unlink(path)  # never write through a hard link into the shared test checkpoint
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + payload)


def replace_json(ckpt, name, value):
    p = os.path.join(ckpt, name)
    if os.path.lexists(p):
        os.unlink(p)
    with open(p, "w") as f:
        f.write(value if isinstance(value, str) else json.dumps(value))


def one_shard(ckpt):
    """The checkpoint's first layer shard: (path, header entries, payload bytes)."""
    p = os.path.join(ckpt, "model-00002-of-00010.safetensors")
    h = read_header(p)
    data = open(p, "rb").read()[8 + h.header_len:]
    return p, dict(h.tensors), data


def test_config_top_level_not_an_object(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    replace_json(ck, "config.json", [1, 2])
    assert_only(facts(ck), "model.config", "config.json holds a list at the top, not an object", "restore config.json")


def test_config_wrong_type_and_altered_value(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    edit_config(ck, hidden_size="256")
    assert_only(facts(ck), "model.config_types", "config.json: hidden_size is a string ('256'), expected an integer")
    edit_config(ck, hidden_size=256, torch_dtype="float16")
    assert_only(facts(ck), "model.config_values", "torch_dtype 'float16'", "'bfloat16'", "restore those fields")
    edit_config(ck, torch_dtype="bfloat16", num_hidden_layers=0)
    assert_only(facts(ck), "model.config_values", "num_hidden_layers 0 (must be at least 1)")
    edit_config(ck, num_hidden_layers=5, n_routed_experts=2 ** 40)  # refused before the inventory walks them
    assert_only(facts(ck), "model.config_values", "n_routed_experts 1099511627776 (at most 4096)")
    edit_config(ck, n_routed_experts=8, vocab_size=None)
    assert_only(facts(ck), "model.config_types", "vocab_size is absent, expected an integer")


@pytest.mark.parametrize("header, phrase", [
    ([1, 2, 3], "header JSON is not an object"),
    ({"x": {"shape": [1], "data_offsets": [0, 2]}}, "x: dtype None is not a safetensors dtype"),
    ({"x": {"dtype": "F7", "shape": [1], "data_offsets": [0, 2]}}, "x: dtype 'F7' is not a safetensors dtype"),
    ({"x": {"dtype": "BF16", "shape": [-1], "data_offsets": [0, 2]}}, "x: shape [-1] is not a list of non-negative"),
    ({"x": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 2]}},
     "x: data_offsets [0, 2] span 2 bytes, BF16 [2] is 4"),
    ({"x": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]},
      "y": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}, "y: data_offsets overlap another tensor's"),
    ({"x": {"dtype": "BF16", "shape": [1], "data_offsets": [2, 4]}}, "x: 2 bytes of gap before it"),
    ({"x": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}, "__metadata__": {"format": 1}},
     "__metadata__ is not an object of strings"),
    (b'{"x": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}, "x": {"dtype": "BF16", "shape": [1], '
     b'"data_offsets": [0, 2]}}', "tensor x is listed twice in the header"),
    (b' {"x": 1}', "header JSON is not an object (it does not start with '{')"),
    (b'{"x": ', "header is not JSON"),
])
def test_bad_safetensors_headers_refused(unit_ckpt, tmp_path, header, phrase):
    """As strict as the safetensors library: SGLang's loader would refuse each of these files."""
    ck = clone(unit_ckpt, tmp_path / "c")
    raw_shard(os.path.join(ck, "model-00002-of-00010.safetensors"), header, b"\0" * 4)
    assert_only(facts(ck), "model.shards", "model-00002-of-00010.safetensors: " + phrase, "re-download")


def test_overlapping_offsets_in_a_real_shard(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    p, tensors, data = one_shard(ck)
    a, b = sorted(tensors, key=lambda n: tensors[n]["data_offsets"])[:2]
    tensors[b] = dict(tensors[b], data_offsets=[0, tensors[b]["data_offsets"][1] - tensors[b]["data_offsets"][0]])
    raw_shard(p, tensors, data)
    line = assert_only(facts(ck), "model.shards", "data_offsets overlap another tensor's")
    from safetensors import SafetensorError, safe_open

    with pytest.raises(SafetensorError):  # the library agrees
        safe_open(p, "pt")
    assert "model-00002" in line


def test_index_entries_outside_the_model_folder(unit_ckpt, tmp_path):
    """Absolute or '..' entries: SGLang keeps only the folder's own *.safetensors files, so it would load
    none of those tensors, even where the named file exists elsewhere."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for entry in (str(outside / "model-00004-of-00010.safetensors"), "../elsewhere/model-00004-of-00010.safetensors",
                  "sub/model-00004-of-00010.safetensors", "model-00004-of-00010.bin", 4):
        ck = clone(unit_ckpt, tmp_path / f"c{abs(hash(str(entry)))}")
        shutil.copy(os.path.join(ck, "model-00004-of-00010.safetensors"), outside)
        os.unlink(os.path.join(ck, "model-00004-of-00010.safetensors"))
        index = json.load(open(os.path.join(ck, "model.safetensors.index.json")))
        index["weight_map"] = {n: (entry if s == "model-00004-of-00010.safetensors" else s)
                               for n, s in index["weight_map"].items()}
        replace_json(ck, "model.safetensors.index.json", index)
        assert_only(facts(ck), "model.index", "entries that SGLang would not load",
                    "keep the shards in the model folder")


def test_tensor_stored_in_two_shards(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    p, tensors, data = one_shard(ck)
    extra = "embed.weight"
    emb = read_header(os.path.join(ck, "model-00001-of-00010.safetensors")).tensors[extra]
    n = emb["data_offsets"][1] - emb["data_offsets"][0]
    end = len(data)
    tensors[extra] = dict(emb, data_offsets=[end, end + n])
    raw_shard(p, tensors, data + b"\0" * n)
    assert_only(facts(ck), "model.shards", "embed.weight is also stored in model-00001-of-00010.safetensors",
                "one shard only")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_files_missing_or_unparsable(unit_ckpt, tmp_path, name):
    ck = clone(unit_ckpt, tmp_path / "c")
    os.unlink(os.path.join(ck, name))
    assert_only(facts(ck), "model.tokenizer", f"{name}: missing", "--skip-tokenizer-init")
    replace_json(ck, name, '{"model": ')
    assert_only(facts(ck), "model.tokenizer", f"{name} is not JSON")
    f = facts(ck)
    f.model = cc.collect_model(ck, tokenizer=False)  # the server skips the tokenizer: nothing to check
    assert failed(f) == {}


def test_tokenizer_json_the_library_refuses(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    replace_json(ck, "tokenizer.json", {"model": {"type": "NoSuchModel"}})
    assert_only(facts(ck), "model.tokenizer", "tokenizer.json does not load in the tokenizers library")


def test_a_directory_or_device_where_a_shard_should_be(unit_ckpt, tmp_path):
    ck = clone(unit_ckpt, tmp_path / "c")
    p = os.path.join(ck, "model-00004-of-00010.safetensors")
    os.unlink(p)
    os.mkdir(p)
    assert_only(facts(ck), "model.shards", "model-00004-of-00010.safetensors: a directory, not a file",
                f"remove the directory {p}")
    os.rmdir(p)
    os.symlink("/dev/null", p)
    assert_only(facts(ck), "model.shards", "a character device, not a regular file", f"replace {p}")


def test_permission_problems_get_a_permission_fix(unit_ckpt, tmp_path):
    from dsv4_sm80.gate import model_checks
    from dsv4_sm80.gate.facts import FileFact

    found, fix = model_checks.file_problem(FileFact("config.json", "denied", detail="PermissionError: Permission "
                                                                                     "denied"), "/m")
    assert found == "not readable (PermissionError: Permission denied)"
    assert "chmod a+r /m/config.json" in fix and "chown" in fix and "download" not in fix
    if os.geteuid() == 0:
        pytest.skip("root reads any file: the collector's side needs an unprivileged user")
    ck = clone(unit_ckpt, tmp_path / "c")
    os.chmod(os.path.join(ck, "config.json"), 0)
    assert_only(facts(ck), "model.config", "config.json: not readable", "chmod a+r")


def test_a_check_that_raises_is_its_own_fail_line(monkeypatch):
    def boom(m):
        raise KeyError("weight_map")

    monkeypatch.setattr(cc, "check_tokenizer", boom)
    line = assert_only(facts(), "model.tokenizer", "the check stopped on KeyError: 'weight_map'")
    assert "Traceback" not in line


def test_json_report_for_a_broken_checkpoint(unit_ckpt, tmp_path, capsys):
    """--json prints the report (never nothing) for inputs that used to raise inside the gate."""
    ck = clone(unit_ckpt, tmp_path / "c")
    raw_shard(os.path.join(ck, "model-00003-of-00010.safetensors"), {"x": {"shape": [1], "data_offsets": [0, 2]}},
              b"\0\0")
    replace_json(ck, "config.json", "[]")
    assert cc.main(["--model-path", ck, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {"model.config"} <= {c["check"] for c in doc["checks"] if c["status"] == "fail"}
