"""The gate's compatibility checks: pure functions of the facts (SGLang, GPUs, patch, knobs, JIT
caches, the server's arguments and the stages' rules on them). The checkpoint's checks are in `model_checks`."""

from __future__ import annotations

from .. import env, jitcache, upstream
from ..seams import SERVER_ARGS, ServerArg
from .facts import GpuFacts, InterconnectFacts, ModelFacts, PatchFacts, SGLangFacts
from .report import Finding, fail, ok, skip, warn

A800_MIN_MEMORY_GIB = 75.0  # an 80 GB card reports ~79.2 GiB; 40 GB A100s cannot hold the weights


def check_sglang(f: SGLangFacts) -> list[Finding]:
    want = f"SGLang {env.SGLANG_VERSION} @ {env.SGLANG_COMMIT[:8]}"
    if f.location is None:
        return [fail("sglang.installed", "no importable sglang package", want,
                      "run inside the official lmsysorg/sglang:v0.5.16 image or install sglang==0.5.16")]
    out = [ok("sglang.installed", f.location)]
    if f.version and f.version.startswith("0.5.17"):
        out.append(fail("sglang.version", f"{f.version} (the 0.5.17 dev-preview)", want,
                         "dsv4-sm80 must never be mixed with the 0.5.17 dev-preview image; use the v0.5.16 image"))
    elif f.version != env.SGLANG_VERSION:
        out.append(fail("sglang.version", f"{f.version}", want, "use the SGLang v0.5.16 image / sglang==0.5.16"))
    else:
        out.append(ok("sglang.version", f.version))
    if f.sglang_root:
        if not f.under_root:
            out.append(fail("sglang.location", f"sglang imported from {f.location}",
                             f"the tree at SGLANG_ROOT={f.sglang_root}/python",
                             "put SGLANG_ROOT/python on PYTHONPATH after the overlay directories"))
        if f.git_commit != env.SGLANG_COMMIT:
            out.append(fail("sglang.commit", f"git HEAD {f.git_commit} at {f.sglang_root}", env.SGLANG_COMMIT,
                             "check out fdebc938 (v0.5.16); never the 0.5.17 dev-preview"))
        else:
            out.append(ok("sglang.commit", f"git HEAD {f.git_commit[:12]} at {f.sglang_root}"))
        if f.git_dirty:
            out.append(fail("sglang.tree_clean", f"{len(f.git_dirty)} modified files under {f.sglang_root}/python "
                             f"(e.g. {f.git_dirty[0]})", "the untouched 0.5.16 tree",
                             "restore it (git checkout -- python); dsv4-sm80 patches at runtime only"))
    if f.fingerprint_mismatch:
        rel, what = next(iter(f.fingerprint_mismatch.items()))
        out.append(fail("sglang.fingerprint", f"{len(f.fingerprint_mismatch)} of {len(upstream.FINGERPRINTS)} "
                         f"fingerprinted files differ (e.g. {rel}: {what})", f"the files of {want}",
                         "use the untouched v0.5.16 tree; a modified or other-version SGLang cannot take the seams"))
    else:
        out.append(ok("sglang.fingerprint", f"{len(upstream.FINGERPRINTS)} files match {want}"))
    return out


def _lab_value(lab, name):
    v = lab.get(name)
    return None if v is None else v.strip()


def check_gpus(f: GpuFacts, lab: dict) -> list[Finding]:
    want_count, want_cc = 4, "8.0"
    lab_count, lab_cc = _lab_value(lab, env.LAB_GPU_COUNT.name), _lab_value(lab, env.LAB_CC.name)
    fix_lab = "run on 4 x A800/A100 80GB (SM80)"
    out = []
    if lab_count is not None:
        if not lab_count.isdigit() or int(lab_count) < 1:
            return [fail("gpu.count", f"{env.LAB_GPU_COUNT.name}={lab_count!r}", "a positive integer",
                         "fix the lab override")]
        want_count = int(lab_count)
    if lab_cc is not None:
        want_cc = lab_cc
    devs = f.devices
    desc = ": " + ", ".join(f"{d['name']} (cc {d['cc']})" for d in devs) if devs else ""
    suffix = f" ({f.error})" if f.error else ""
    if len(devs) != want_count:
        out.append(fail("gpu.count", f"{len(devs)} visible GPUs{suffix}{desc}",
                         f"exactly {want_count}" + ("" if lab_count else " (4 x A800 80GB, tensor parallel 4)"),
                         f"{fix_lab}; CUDA_VISIBLE_DEVICES must list exactly four" if not lab_count
                         else "check the lab machine"))
    else:
        out.append(ok("gpu.count", f"{len(devs)} visible GPUs{desc}"))
    if not devs:
        out.append(skip("gpu.capability", "no GPU"))
        out.append(skip("gpu.memory", "no GPU"))
        return out
    bad = [d for d in devs if d["cc"] != want_cc]
    if bad:
        out.append(fail("gpu.capability", f"compute capability {', '.join(sorted({d['cc'] for d in bad}))} "
                         f"on {len(bad)} GPU(s) ({bad[0]['name']})",
                         f"every GPU {want_cc}" + ("" if lab_cc else " (SM80: A800/A100)"),
                         f"{fix_lab}; SM90+ GPUs should run native SGLang ({env.PATCH.name}=0)" if not lab_cc
                         else "check the lab machine"))
    else:
        out.append(ok("gpu.capability", f"all {want_cc}"))
    small = [d for d in devs if d["memory_gib"] < A800_MIN_MEMORY_GIB]
    if small:
        out.append(fail("gpu.memory", f"{small[0]['memory_gib']} GiB on {small[0]['name']}",
                         f">= {A800_MIN_MEMORY_GIB} GiB per GPU (weights alone are ~39 GiB per GPU at TP4)",
                         "use 80 GB cards"))
    else:
        out.append(ok("gpu.memory", f"min {min(d['memory_gib'] for d in devs)} GiB"))
    return out


# SGLang 0.5.16 builds its custom all-reduce (the JIT kernel by default, the legacy one otherwise; both ask
# can_use_custom_all_reduce_with_nvlink) only where NVLink joins every pair of GPUs, or on exactly two GPUs whose
# P2P over PCIe passes its test; above two GPUs without full NVLink it falls back to NCCL by itself, here:
CUSTOM_AR_RULE = "srt/distributed/device_communicators/custom_all_reduce_utils.py:465"
# --enable-mscclpp needs no such guard: SGLang 0.5.16 runs MSCCL++ only at 8, 16 or 32 ranks
# (pymscclpp.py, PyMscclppCommunicator._SUPPORTED_WORLD_SIZES) and falls back to NCCL below; the product runs 4.


def custom_all_reduce_allowed(f: InterconnectFacts | None) -> bool:
    """SGLang's custom all-reduce may run only where NVML shows NVLink between every pair of the visible GPUs:
    over PCIe it can return a wrong sum without any error, NCCL costs only speed. An interconnect NVML cannot
    read counts as PCIe."""
    return f is not None and f.error is None and all(p["nvlink"] for p in f.pairs)


def interconnect_launch_args(f: InterconnectFacts | None) -> dict:
    """The server arguments the launch sets for the interconnect (the launch stage applies them)."""
    return {} if custom_all_reduce_allowed(f) else {"disable_custom_all_reduce": True}


def _links_text(links: list) -> str:
    if not links:
        return ""
    if len(set(links)) == 1:
        return f" ({links[0]} active NVLinks per GPU)"
    return f" (active NVLinks per GPU: {', '.join(map(str, links))})"


def check_interconnect(f: InterconnectFacts | None) -> Finding:
    """NVLink between all visible GPUs: SGLang's custom all-reduce on; anything else: turned off at launch,
    with the reason and what it costs."""
    name = "gpu.interconnect"
    off = "SGLang's custom all-reduce turned off (the launch sets --disable-custom-all-reduce"
    if f is None:
        return skip(name, "not collected")
    if f.error:
        return warn(name, f"unknown ({f.error}): {off}; it runs only where NVLink between all GPUs is known); "
                          "`nvidia-smi topo -m` shows the links (NV# between every pair of GPUs, not PIX/PXB/PHB/"
                          "NODE/SYS)")
    if f.gpus < 2:
        return ok(name, f"{f.gpus} GPU: no all-reduce between GPUs")
    if custom_all_reduce_allowed(f):
        return ok(name, f"{f.gpus} GPUs, NVLink between all pairs{_links_text(f.links)}: SGLang's custom "
                        "all-reduce on")
    pcie = [f"{p['a']}-{p['b']}" for p in f.pairs if not p["nvlink"]]
    nvlink = [f"{p['a']}-{p['b']}" for p in f.pairs if p["nvlink"]]
    where = (f"GPU {', '.join(pcie)} PCIe only (NVLink: {', '.join(nvlink)})" if nvlink
             else f"no NVLink between any of the {f.gpus} GPUs (PCIe only)")
    sglang = (f"SGLang 0.5.16 also turns it off above two GPUs without NVLink between all, {CUSTOM_AR_RULE}"
              if f.gpus > 2 else f"SGLang 0.5.16 would keep it on two PCIe GPUs: {CUSTOM_AR_RULE} turns it off "
                                 "only above two")
    return warn(name, f"{where}: {off}; {sglang}); the tensor-parallel all-reduce runs on NCCL over PCIe, expect "
                      "it to take a large share of decode time (the intended machine has NVLink between all four)")


def check_env_knobs(knobs: dict | None) -> Finding:
    """Every dsv4-sm80 knob the launch sees holds one of its documented values (README "Environment")."""
    if knobs is None:
        return skip("env.knobs", "not collected")
    for knob in env.KNOBS:
        try:
            env.get(knob, knobs)
        except env.EnvError:
            return fail("env.knobs", f"{knob.name}={knobs.get(knob.name)!r}", f"one of {', '.join(knob.choices)}: "
                         f"{knob.doc}", f"set {knob.name} to one of {', '.join(knob.choices)}, or unset it for "
                         f"{knob.default!r}")
    return ok("env.knobs", f"{len(knobs)} set, all within their values")


def check_jit_cache(dirs: list | None) -> list[Finding]:
    """Each JIT cache directory writable, with room on its disk: a cold start compiles into them, and a
    disk that fills half-way fails deep inside a compiler."""
    if dirs is None:
        return [skip("jit.cache", "not collected")]
    out, need = [], jitcache.MIN_FREE_BYTES
    for d in dirs:
        var = d.label[d.label.find("(") + 1:d.label.find(")")] if "(" in d.label else "its cache variable"
        if not d.writable:
            out.append(fail("jit.cache", f"{d.label} at {d.path}: not writable ({d.error or 'no write access'})",
                             "a writable cache directory",
                             f"fix its permissions, or set {var} to a writable directory"))
        elif d.free_bytes is not None and d.free_bytes < need:
            out.append(fail("jit.cache", f"{d.label} at {d.path}: {jitcache.gib(d.free_bytes)} free on its disk",
                             f">= {jitcache.gib(need)} free (a cold start compiles kernels into it)",
                             f"free space there, or set {var} to a disk with room"))
    if not out:
        free = min((d.free_bytes for d in dirs if d.free_bytes is not None), default=None)
        cold = [d for d in dirs if d.ours_built is False]
        missing = [m for d in dirs for m in (d.modules_missing or [])]
        note = ("; this path's Triton kernels are not built here yet: the first requests compile them (minutes; "
                "SGLang's --watchdog-timeout, 300 s, counts them: README, first start)") if cold else ""
        if missing:
            note += (f"; SGLang's JIT modules {', '.join(missing)} are not built here yet: the first forward builds "
                     "them (minutes; under the same watchdog)")
        out.append(ok("jit.cache", f"{len(dirs)} cache directories writable, least free {jitcache.gib(free)}{note}"))
    return out


MIN_NVCC_TEXT = ".".join(map(str, jitcache.MIN_NVCC))


def check_jit_compiler(n: jitcache.NvccFacts | None) -> Finding:
    """The nvcc SGLang's JIT builds run (jitcache.nvcc_facts): present and a release TileLang's C++20 builds
    accept; otherwise the first build (the mHC prewarm, while loading) fails half-way into the start."""
    if n is None:
        return skip("jit.compiler", "not collected")
    want = (f"nvcc {MIN_NVCC_TEXT}+ (SGLang's JIT kernels, the TileLang mHC kernels and FlashInfer's sampling "
            "compile for sm_80 at first use)")
    if n.path is None or n.version is None:
        return fail("jit.compiler", f"{n.error} (looked up via {n.how})", want,
                     "install the CUDA toolkit (SGLang's image has it at /usr/local/cuda) or set CUDA_HOME to it")
    if tuple(int(x) for x in n.version.split(".")) < jitcache.MIN_NVCC:
        return fail("jit.compiler", f"nvcc {n.version} at {n.path} ({n.how})", want,
                     f"point CUDA_HOME at a CUDA {MIN_NVCC_TEXT}+ toolkit")
    return ok("jit.compiler", f"nvcc {n.version} at {n.path} ({n.how})")


def check_patch(f: PatchFacts) -> Finding:
    want = f"{env.PATCH.name}=1 and dsv4-sm80's sitecustomize with its seam finder installed"
    if f.env_value.strip() != "1":
        return fail("patch.active", f"{env.PATCH.name}={f.env_value!r} in {f.where}", want,
                     f"export {env.PATCH.name}=1 (0 runs SGLang natively, which has no SM80 datapath for DSV4)")
    if not f.ours:
        return fail("patch.active", f"sitecustomize {f.sitecustomize} in {f.where} is not dsv4-sm80's", want,
                     "put the overlay directory first on PYTHONPATH "
                     "(/sgl-workspace/platform:/sgl-workspace/sm80-patch:/sgl-workspace/sglang/python)")
    if f.error or not f.hook_installed:
        return fail("patch.active", f"the patch did not install in {f.where}: {f.error or 'no seam finder'}", want,
                     "fix the reported error (see the dsv4-sm80 line printed at interpreter start)")
    return ok("patch.active", f"{f.where}: {f.sitecustomize}")


def check_sglang_knobs(f: PatchFacts) -> Finding:
    """The import-time SGLang knobs the SM80 datapath needs (env.IMPORT_TIME_DEFAULTS): sitecustomize
    sets them where unset; a user value that differs would put an SM90-only kernel on the path."""
    if f.env_value.strip() != "1" or not f.hook_installed:
        return skip("patch.sglang_knobs", "patch not active")
    bad = [d for d in env.IMPORT_TIME_DEFAULTS if f.knobs.get(d.name) != d.value]
    if bad:
        d = bad[0]
        return fail("patch.sglang_knobs", f"{d.name}={f.knobs.get(d.name)!r} in {f.where}",
                     f"{d.name}={d.value} ({d.reason})", f"unset {d.name} (dsv4-sm80 sets it) or set it to {d.value}")
    return ok("patch.sglang_knobs", ", ".join(f"{d.name}={d.value}" for d in env.IMPORT_TIME_DEFAULTS))


def is_loopback(host: str | None) -> bool:
    h = (host or "127.0.0.1").strip().strip("[]").lower()
    return h in ("localhost", "::1", "ip6-localhost") or h.startswith("127.")


def check_bind(host: str | None, has_api_key: bool, environ=None) -> Finding:
    """A patched server on a non-loopback address needs --api-key, or the logged opt-out
    DSV4_SM80_ALLOW_OPEN_BIND=1. Never sees or prints the key itself, only whether one is set."""
    host = host or "127.0.0.1"
    if is_loopback(host):
        return ok("server.bind", f"{host} (loopback)")
    if has_api_key:
        return ok("server.bind", f"{host} with an API key (requests without it are rejected)")
    if env.get(env.ALLOW_OPEN_BIND, environ) == "1":
        return ok("server.bind", f"{host} WITHOUT an API key ({env.ALLOW_OPEN_BIND.name}=1): anyone who can "
                                  "reach this port can use the model")
    return fail("server.bind", f"--host {host} (not loopback) without --api-key",
                 "--api-key KEY for any address other than loopback",
                 f"add --api-key (clients send 'Authorization: Bearer KEY'), bind 127.0.0.1, or set "
                 f"{env.ALLOW_OPEN_BIND.name}=1 to serve it open on purpose")


# SGLang modes that change how DSV4's attention or experts are scheduled and that the SM80 datapath has never
# run (no CPU test, no lab run): refused with the patch on rather than served unverified. (attribute, flag,
# what it does); each is off by default in SGLang 0.5.16 for DSV4.
UNVERIFIED_MODES = (
    ("enable_dp_attention", "--enable-dp-attention", "data-parallel attention (gathered batches, padded metadata)"),
    ("enable_two_batch_overlap", "--enable-two-batch-overlap", "two-batch overlap (an expert-parallel schedule)"),
    ("enable_single_batch_overlap", "--enable-single-batch-overlap", "single-batch overlap (expert-parallel)"),
    ("enable_hierarchical_cache", "--enable-hierarchical-cache", "KV pages offloaded to host memory"),
    ("enable_hisparse", "--enable-hisparse", "hierarchical sparse attention: a host-offloaded DSV4 pool with its "
                                             "own layout and transfer kernels, never adapted to the BF16 KV cache "
                                             "(SGLang's own HiSparse check passes at launch: the dtype is still FP8)"),
    ("enable_pdmux", "--enable-pdmux", "prefill/decode multiplexing on split SMs"),
    ("enable_mixed_chunk", "--enable-mixed-chunk", "decode tokens mixed into prefill batches"),
    ("enable_torch_compile", "--enable-torch-compile", "torch.compile over the model, the SM80 seams and Triton "
                                                       "kernels inside it"),
    ("disaggregation_mode", "--disaggregation-mode", "prefill/decode disaggregation (KV pages sent between "
                                                     "servers in the native layout)"),
    ("pp_size", "--pp-size", "pipeline parallelism (this path has run tensor parallelism only)"),
    ("nnodes", "--nnodes", "more than one node (the gate checks one host's 4 GPUs; nothing multi-node has run)"),
    ("dp_size", "--dp-size", "data-parallel replicas (a DP controller over several TP groups)"),
    ("enable_lora", "--enable-lora", "LoRA adapters (their kernels around the SM80 linears)"),
    ("lora_paths", "--lora-paths", "LoRA adapters (their kernels around the SM80 linears)"),
    ("enable_deterministic_inference", "--enable-deterministic-inference",
     "deterministic inference (SGLang swaps attention and reduction kernels for batch-invariant ones)"),
    ("enable_eplb", "--enable-eplb", "expert-parallel load balancing"),
    ("enable_dp_lm_head", "--enable-dp-lm-head", "a data-parallel LM head"),
)
COUNT_MODES = ("pp_size", "nnodes", "dp_size")  # refused above 1, named with their value


def _mode_on(attr: str, value) -> bool:
    if attr == "disaggregation_mode":
        return value not in (None, "null", "none")
    if attr in COUNT_MODES:
        return int(value or 1) > 1
    return bool(value)


def check_modes(server_args) -> Finding:
    """The modes in UNVERIFIED_MODES, with the patch on: any one set is refused, naming its flag."""
    on = []
    for attr, flag, what in UNVERIFIED_MODES:
        value = getattr(server_args, attr, None)
        if _mode_on(attr, value):
            on.append((f"{flag} {value}" if attr == "disaggregation_mode" or attr in COUNT_MODES else flag, what))
    if not on:
        return ok("server.modes", "none of the unverified SGLang modes")
    return fail("server.modes", "; ".join(f"{flag} ({what})" for flag, what in on),
                 "none of " + ", ".join(flag for _, flag, _ in UNVERIFIED_MODES) + " (the SM80 datapath has not "
                 "run them)", "drop " + ", ".join(flag.split()[0] for flag, _ in on))


EAGLE_LIKE = ("EAGLE", "EAGLE3", "NEXTN")


def check_speculative(algorithm: str | None, m: ModelFacts) -> Finding:
    """`--speculative-algorithm NEXTN/EAGLE` needs a V3-style MTP layer (`mtp.N.e_proj`/`h_proj`, the
    original V4-Flash release). The 0731 and Vision-Exp releases carry a DSPARK draft instead; NextN on
    them builds its projections from nothing and runs on uninitialised weights (accept rate 0, slower
    than no speculation) without any error. Refused here, before SGLang starts."""
    algo = (algorithm or "").upper()
    if algo not in EAGLE_LIKE:
        return ok("speculative.draft", algo or "no speculative decoding")
    names = m.weight_map
    if names is None:
        return skip("speculative.draft", f"{algo}: needs the checkpoint index to find its draft weights")
    has_nextn = any(n.startswith("mtp.") and (".e_proj." in n or ".h_proj." in n) for n in names)
    if has_nextn:
        return ok("speculative.draft", f"{algo}: the checkpoint has MTP e_proj/h_proj")
    dspark = any(n.startswith("mtp.") for n in names)
    return fail("speculative.draft",
                 f"--speculative-algorithm {algo} on a checkpoint without mtp.*.e_proj / h_proj"
                 + (" (it carries a DSPARK draft: the 0731 / Vision-Exp releases)" if dspark else ""),
                 "a V3-style MTP layer for NEXTN/EAGLE (it would run on uninitialised weights: accept rate 0)",
                 "use --speculative-algorithm DSPARK" if dspark else "drop --speculative-algorithm")


def check_server_arg(rule: ServerArg, server_args) -> Finding:
    """One stage's rule on a server argument (seams.SERVER_ARGS): a value the launch replaces, one it keeps, or a
    refusal naming the flag."""
    value = rule.value(server_args)
    if value in rule.sets:
        return ok(rule.name, f"{rule.flag} {value}, set to {rule.sets[value]} at launch")
    if value in rule.runs:
        return ok(rule.name, f"{rule.flag} {value}")
    then = f" (the launch then sets {rule.sets[rule.default]})" if rule.default in rule.sets else ""
    return fail(rule.name, f"{rule.flag} {value}", f"{' or '.join([*rule.sets, *rule.runs])}: {rule.why}",
                f"drop {rule.flag}{then}")


def server_arg_settings(server_args) -> dict:
    """attribute -> value for every SERVER_ARGS rule whose value the launch replaces."""
    return {r.attr: r.sets[v] for r in SERVER_ARGS if (v := r.value(server_args)) in r.sets}
