"""SGLang's launch_server command line, read before SGLang reads it: the server arguments the gate's checks judge
(`serve` and `doctor` check them before anything launches; the launch stage judges SGLang's own parse again), one
flag's value, and the command with its secrets hidden for printing.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..seams import SERVER_ARGS
from .checks import UNVERIFIED_MODES

# The attributes the gate's server checks read, each spelled on the command line as SGLang 0.5.16's parser spells
# it: `--` and the attribute with dashes, plus SGLang's aliases (tests/unit/test_gate_argv.py holds them to
# ServerArgs.add_cli_args). A switch takes no value, a list all values up to the next option.
ATTRS = ("model_path", "tokenizer_path", "skip_tokenizer_init", "host", "api_key", "speculative_algorithm",
         *(attr for attr, _, _ in UNVERIFIED_MODES), *(rule.attr for rule in SERVER_ARGS))
ALIASES = {"model_path": ("--model",), "ep_size": ("--expert-parallel-size", "--ep"),
           "pp_size": ("--pipeline-parallel-size",), "dp_size": ("--data-parallel-size",)}
SWITCHES = {"skip_tokenizer_init", *(attr for attr in ATTRS if attr.startswith("enable_"))}
LISTS = {"lora_paths"}


def flags(attr: str) -> tuple[str, ...]:
    return ("--" + attr.replace("_", "-"), *ALIASES.get(attr, ()))


def kind(attr: str) -> str:
    return "flag" if attr in SWITCHES else "values" if attr in LISTS else "value"


SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password")


def server_args(argv) -> SimpleNamespace:
    """The ATTRS `argv` names (the last one wins, as in argparse); the gate's checks take an absent one
    as SGLang's default. Everything else on the command line is SGLang's alone."""
    by_flag = {f: (attr, kind(attr)) for attr in ATTRS for f in flags(attr)}
    out, i = {}, 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        i += 1
        if name not in by_flag:
            continue
        attr, how = by_flag[name]
        if how == "flag":
            out[attr] = True
        elif eq:
            out[attr] = inline if how == "value" else [inline]
        elif how == "value":
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
