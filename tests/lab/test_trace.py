"""The lab's module-by-module forward trace (dsv4_lab/trace.py), attached through SGLang 0.5.16's own
forward-hook mechanism (sglang.srt.model_executor.hook_manager.register_forward_hooks) to a small torch model
shaped like DSV4's (a top module whose `model` has `embed_tokens` and `layers`, layers called with keyword
arguments, the model module called through `.forward` as DeepseekV4ForCausalLM does): what it records, when,
and that the comparison names the module that adds a difference."""

import os

import pytest
import torch
from torch import nn

from dsv4_lab import trace as lab_trace

ROWS = 5


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)

    def forward(self, *, hidden_states, positions):  # DSV4's decoder layers take keywords only
        h = hidden_states + self.self_attn(hidden_states)
        return h + self.mlp(h), positions


class Model(nn.Module):
    def __init__(self, d=8, n=3, vocab=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)

    def forward(self, input_ids, positions):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h, _ = layer(hidden_states=h, positions=positions)
        return self.norm(h)


class Top(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Model()
        self.lm_head = nn.Linear(8, 32)

    def forward(self, input_ids, positions):  # as DeepseekV4ForCausalLM: the model through .forward, no hooks
        return self.lm_head(self.model.forward(input_ids, positions))


def traced(tmp, perturb=None, warm=True):
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    torch.manual_seed(0)
    top = Top()
    if perturb:
        perturb(top)
    register_forward_hooks(top, lab_trace.trace_spec(str(tmp), rows=ROWS))
    with torch.no_grad():
        if warm:  # another length first: arms the keyword-argument pre-hooks, records nothing
            top(torch.arange(3), torch.arange(3))
        ids = torch.arange(ROWS) % 7
        top(ids, torch.arange(ROWS))
        top(ids[:1], torch.arange(1))  # a decode step of one token: not recorded
        top(ids, torch.arange(ROWS))  # a second prefill of that length: forwards=1 keeps the first only
    return torch.load(os.path.join(tmp, "forward-0-rank0.pt"), weights_only=False)


def test_records_every_module_in_call_order_with_keyword_inputs(tmp_path):
    rec = traced(tmp_path)
    names = [r["name"] for r in rec]
    assert names == ["model.embed_tokens", "model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.0",
                     "model.layers.1.self_attn", "model.layers.1.mlp", "model.layers.1",
                     "model.layers.2.self_attn", "model.layers.2.mlp", "model.layers.2", "model.norm"]
    assert sorted(os.listdir(tmp_path)) == ["forward-0-rank0.pt"]
    layer0 = rec[names.index("model.layers.0")]
    # the layer's input came as a keyword argument; positions are not floating tensors and are not kept
    assert len(layer0["in"]) == 1 and layer0["in"][0].shape == (ROWS, 8)
    assert torch.equal(layer0["in"][0], rec[0]["out"][0])  # the embedding's output is layer 0's input
    assert torch.equal(rec[names.index("model.layers.1")]["in"][0], layer0["out"][0])
    assert rec[0]["in"] == [] and rec[-1]["out"][0].shape == (ROWS, 8)  # input_ids are not floating


def test_the_model_comes_from_sglangs_registration_not_a_scan(tmp_path, monkeypatch):
    def no_scan(module):
        raise AssertionError("scanned the garbage collector although register_forward_hooks held the model")

    monkeypatch.setattr(lab_trace, "_scan_for_root", no_scan)
    rec = traced(tmp_path, warm=False)  # armed at registration: the prompt's first prefill is the one recorded
    assert [r["name"] for r in rec][:2] == ["model.embed_tokens", "model.layers.0.self_attn"]
    assert rec[3]["name"] == "model.layers.0" and rec[3]["in"][0].shape == (ROWS, 8)


def hook_by_hand(tmp, top):
    """The factory called outside register_forward_hooks (no model in its caller): it must find the model by
    one scan on the first hook call."""
    hook = lab_trace.factory(lab_trace.trace_spec(str(tmp), rows=ROWS)[0]["config"])
    for name, m in top.named_modules():
        if name.startswith("model."):
            m.register_forward_hook(hook)
    return hook


def test_outside_sglang_the_first_call_scans_once_and_that_forward_is_not_recorded(tmp_path, monkeypatch):
    calls = []
    real = lab_trace._scan_for_root
    monkeypatch.setattr(lab_trace, "_scan_for_root", lambda m: calls.append(m) or real(m))
    torch.manual_seed(0)
    top = Top()
    hook_by_hand(tmp_path, top)
    ids = torch.arange(ROWS) % 7
    with torch.no_grad():
        top(ids, torch.arange(ROWS))  # arms: not recorded
        top(ids, torch.arange(ROWS))
    assert len(calls) == 1
    rec = torch.load(os.path.join(tmp_path, "forward-0-rank0.pt"), weights_only=False)
    assert [r["name"] for r in rec] == [r["name"] for r in traced(tmp_path / "ref")]


def test_a_model_that_cannot_be_found_turns_tracing_off_once(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(lab_trace, "_scan_for_root", lambda m: calls.append(m))  # finds nothing
    top = Top()
    hook_by_hand(tmp_path, top)
    with torch.no_grad():
        for _ in range(3):
            top(torch.arange(ROWS), torch.arange(ROWS))
    assert len(calls) == 1 and not os.path.exists(os.path.join(tmp_path, "forward-0-rank0.pt"))
    assert "nothing will be traced" in capsys.readouterr().err


def test_compare_names_the_module_that_adds_the_difference(tmp_path):
    ref = traced(tmp_path / "a")

    def bump(top):  # layer 1's MLP computes something else; everything before it is identical
        with torch.no_grad():
            top.model.layers[1].mlp.weight.mul_(1.5)

    other = traced(tmp_path / "b", perturb=bump)
    rows = lab_trace.compare(ref, other)
    by = {r["name"]: r for r in rows}
    assert by["model.layers.0"]["out"] == 0.0 and by["model.layers.1.self_attn"]["out"] == 0.0
    assert by["model.layers.1.mlp"]["suspect"] and by["model.layers.1.mlp"]["in"] == 0.0
    assert [r["name"] for r in rows if r["suspect"]][0] == "model.layers.1.mlp"
    # downstream modules inherit the difference without adding much: not suspects
    assert not by["model.layers.2.self_attn"]["suspect"] and by["model.layers.2"]["out"] > 0
    same = lab_trace.compare(ref, ref, floor=other)
    assert not any(r["suspect"] for r in same) and by["model.norm"]["out"] == same[-1]["floor_out"]


def test_cli_prints_the_first_suspect(tmp_path, capsys):
    traced(tmp_path / "a")

    def bump(top):
        with torch.no_grad():
            top.model.layers[2].self_attn.bias.add_(1.0)

    traced(tmp_path / "b", perturb=bump)
    assert lab_trace.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "first module adding the difference: model.layers.2.self_attn" in out
    assert "largest additions: model.layers.2.self_attn 0.00e+00 -> " in out


def test_spec_refuses_a_one_token_trace():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        lab_trace.trace_spec("/tmp/x", rows=1)
    spec = lab_trace.trace_spec("/tmp/x", rows=300)
    assert spec[0]["hook_factory"] == "dsv4_lab.trace:factory" and spec[0]["config"]["rows"] == 300


class Fp8Linear(nn.Module):
    """A linear holding an FP8 weight with one fp32 scale per 128 x 128 block, as SGLang's block-FP8 layers do,
    that computes what native's FP8 linear is modelled to compute: the activation through the per-token,
    per-128 FP8 rounding, an fp32 product with the exact weight, one rounding to BF16."""

    def __init__(self, n, k, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g) * 0.05
        blocks = w.unflatten(0, (n // 128, 128)).unflatten(2, (k // 128, 128))  # [nb, 128, kb, 128]
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        self.weight = nn.Parameter(q.flatten(2).flatten(0, 1), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)

    def forward(self, x):
        from dsv4_lab.rounding import fp8_act

        w = lab_trace.exact_weight({"weight": self.weight, "scale": self.weight_scale_inv}).float()
        return (fp8_act(x) @ w.t()).to(x.dtype)


class Fp8Layer(nn.Module):
    def __init__(self, d, seed):
        super().__init__()
        self.self_attn = Fp8Linear(d, d, seed)
        self.mlp = nn.Linear(d, d, bias=False, dtype=torch.bfloat16)

    def forward(self, *, hidden_states, positions):
        h = hidden_states + self.self_attn(hidden_states)
        return h + self.mlp(h), positions


class Fp8Top(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.model = Model(d=d, n=2)
        self.model.embed_tokens.to(torch.bfloat16)
        self.model.layers = nn.ModuleList(Fp8Layer(d, seed=i) for i in range(2))
        self.model.norm.to(torch.bfloat16)

    def forward(self, input_ids, positions):
        return self.model.forward(input_ids, positions)


def fp8_trace(tmp_path):
    """One forward of Fp8Top traced with params (weights and block scales) into tmp_path; its records."""
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    torch.manual_seed(0)
    top = Fp8Top()
    register_forward_hooks(top, lab_trace.trace_spec(str(tmp_path), rows=ROWS, params=True))
    with torch.no_grad():
        top(torch.arange(ROWS), torch.arange(ROWS))
    return torch.load(os.path.join(tmp_path, "forward-0-rank0.pt"), weights_only=False)


def test_linear_check_tells_an_fp8_activation_linear_from_a_bf16_one(tmp_path, capsys):
    """With params=True the trace keeps each module's weight and block scale; linear_check then replays every
    linear on its own recorded input: the FP8 module's output equals the fp8-act model and sits ~1e-2 from
    exact, the BF16 module's output is the bf16 model and ~1e-3 from exact (models written from the math)."""
    rec = fp8_trace(tmp_path)
    by = {r["name"]: r for r in rec}
    p = by["model.layers.0.self_attn"]["params"]
    assert p["weight"].dtype == torch.float8_e4m3fn and p["scale"].shape == (2, 2)
    assert by["model.layers.0"]["params"] == {} and "params" in by["model.embed_tokens"]  # no 2-D weight of its own
    rows = {r["name"]: r for r in lab_trace.linear_check(rec)}
    # the embedding has a 2-D weight but token ids for input: not a linear
    assert set(rows) == {"model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.1.self_attn",
                         "model.layers.1.mlp"}
    fp8, bf16 = rows["model.layers.0.self_attn"], rows["model.layers.1.mlp"]
    assert fp8["fp8_weight"] and fp8["out_vs_act"] == 0.0
    assert 5e-3 < fp8["out_vs_exact"] < 6e-2 and fp8["bf16_vs_exact"] < 4e-3
    assert not bf16["fp8_weight"] and bf16["out_vs_bf16"] < 4e-3 and bf16["out_vs_exact"] < 4e-3
    assert bf16["out_vs_act"] > 5e-3  # the models are far enough apart to tell which one a kernel computes
    # a scale in another layout (packed words, another block size) is not guessed at
    assert lab_trace.exact_weight({"weight": p["weight"], "scale": p["scale"][:1]}) is None
    assert lab_trace.exact_weight({"weight": p["weight"], "scale": p["scale"].to(torch.int32)}) is None
    assert lab_trace.main([str(tmp_path), "--linears"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn" in out and "output vs exact" in out


def test_linear_check_runs_further_models_and_keeps_the_table_when_one_cannot_run(tmp_path, capsys):
    """`models`: each recorded linear against more models of its arithmetic (on the GPU, native SGLang's own FP8
    quantizer and linear: sglang_models); a model that raises leaves its error in the row, not a crash."""
    rec = fp8_trace(tmp_path)

    def bf16_model(x, p, w):  # the bf16 model again, written out: an fp32 product rounded once
        return (x.float() @ w.float().t()).to(torch.bfloat16)

    def broken(x, p, w):
        raise RuntimeError("no SM90 here")

    rows = {r["name"]: r for r in lab_trace.linear_check(rec, models={"again": bf16_model, "broken": broken})}
    for r in rows.values():
        assert r["out_vs_models"]["again"] == r["out_vs_bf16"]
        assert r["out_vs_models"]["broken"] == "RuntimeError: no SM90 here"
    assert rows["model.layers.1.mlp"]["out_vs_models"]["again"] < 4e-3
    lab_trace.print_linears("t", list(rows.values()))
    out = capsys.readouterr().out
    assert "again 0.00e+00" in out and "ERR RuntimeError: no SM90 here" in out and ", vs again " in out
    # SGLang's own models on this CPU: SGLang imports, its FP8 kernels do not run: every row says why
    assert lab_trace.main([str(tmp_path), "--linears", "--sglang-models"]) == 0
    assert "sglang quant ERR" in capsys.readouterr().out


def test_switches_name_what_deepseek_v4_took_at_import():
    """The trace log says which wo_a arithmetic the traced process ran: deepseek_v4.py's `_FP8_WO_A_GEMM`, read
    from SGLang's own module (CPU: imported here as the scheduler imports it; SGLang's server arguments turn it
    off on SM90 without an explicit opt-in, server_args.py:6685-6703, so a native H200 trace reads False)."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16")
    import sglang.srt.models.deepseek_v4 as dsv4

    from dsv4_lab.trace import _switches

    assert _switches() == f"_FP8_WO_A_GEMM={dsv4._FP8_WO_A_GEMM}"
