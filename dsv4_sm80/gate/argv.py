"""SGLang's launch_server command line, read before SGLang reads it: the server arguments the gate's checks judge
(`serve` and `doctor` check them before anything launches; the launch stage judges SGLang's own parse again), one
flag's value, and the command with its secrets hidden for printing.
"""

from __future__ import annotations

from types import SimpleNamespace

# The flags the gate's server checks read, spelled as SGLang 0.5.16's parser spells them, every alias included
# (tests/unit/test_gate_argv.py holds them to ServerArgs.add_cli_args): attribute -> (flags, kind); a "flag" takes
# no value, a "value" one, "values" all that follow it up to the next option.
FLAGS = {
    "model_path": (("--model-path", "--model"), "value"),
    "tokenizer_path": (("--tokenizer-path",), "value"),
    "skip_tokenizer_init": (("--skip-tokenizer-init",), "flag"),
    "host": (("--host",), "value"),
    "api_key": (("--api-key",), "value"),
    "speculative_algorithm": (("--speculative-algorithm",), "value"),
    "ep_size": (("--ep-size", "--expert-parallel-size", "--ep"), "value"),
    "moe_a2a_backend": (("--moe-a2a-backend",), "value"),
    "moe_runner_backend": (("--moe-runner-backend",), "value"),
    "kv_cache_dtype": (("--kv-cache-dtype",), "value"),
    "enable_dp_attention": (("--enable-dp-attention",), "flag"),
    "enable_two_batch_overlap": (("--enable-two-batch-overlap",), "flag"),
    "enable_single_batch_overlap": (("--enable-single-batch-overlap",), "flag"),
    "enable_hierarchical_cache": (("--enable-hierarchical-cache",), "flag"),
    "enable_hisparse": (("--enable-hisparse",), "flag"),
    "enable_pdmux": (("--enable-pdmux",), "flag"),
    "enable_mixed_chunk": (("--enable-mixed-chunk",), "flag"),
    "enable_torch_compile": (("--enable-torch-compile",), "flag"),
    "disaggregation_mode": (("--disaggregation-mode",), "value"),
    "pp_size": (("--pp-size", "--pipeline-parallel-size"), "value"),
    "nnodes": (("--nnodes",), "value"),
    "dp_size": (("--dp-size", "--data-parallel-size"), "value"),
    "enable_lora": (("--enable-lora",), "flag"),
    "lora_paths": (("--lora-paths",), "values"),
    "enable_deterministic_inference": (("--enable-deterministic-inference",), "flag"),
    "enable_eplb": (("--enable-eplb",), "flag"),
    "enable_dp_lm_head": (("--enable-dp-lm-head",), "flag"),
}

SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password")


def server_args(argv) -> SimpleNamespace:
    """The FLAGS attributes `argv` names (the last one wins, as in argparse); the gate's checks take an absent one
    as SGLang's default. Everything else on the command line is SGLang's alone."""
    by_flag = {f: (attr, kind) for attr, (flags, kind) in FLAGS.items() for f in flags}
    out, i = {}, 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        i += 1
        if name not in by_flag:
            continue
        attr, kind = by_flag[name]
        if kind == "flag":
            out[attr] = True
        elif eq:
            out[attr] = inline if kind == "value" else [inline]
        elif kind == "value":
            if i < len(argv):
                out[attr], i = argv[i], i + 1
        else:
            values = []
            while i < len(argv) and not argv[i].startswith("-"):
                values.append(argv[i])
                i += 1
            out[attr] = values
    return SimpleNamespace(**out)


def flag_value(argv, flag):
    """The value of `flag` in an argv list (`--flag V` or `--flag=V`), the last one wins; None if absent."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def redact(argv):
    """argv with the values of secret flags replaced by ***, for anything printed or logged."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a in SECRET_FLAGS:
            out.append(a)
            hide = True
        elif a.split("=", 1)[0] in SECRET_FLAGS and "=" in a:
            out.append(a.split("=", 1)[0] + "=***")
        else:
            out.append(a)
    return out
