"""The lab's rounding-level perturbation (dsv4_lab/perturb.py), attached through SGLang 0.5.16's own
forward-hook mechanism: exactly one unit in the last place, on about the asked share of entries, repeatable."""

import pytest
import torch
from torch import nn

from dsv4_lab import perturb as lab_perturb


def bits(x):
    return x.view(torch.int16).int() if x.dtype in (torch.bfloat16, torch.float16) else x.view(torch.int32).long()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_picked_entry_moves_exactly_one_ulp(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * 3).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")]).to(dtype)
    y = lab_perturb.ulp_flip(x, 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(bits(y[:3]), bits(x[:3])) and torch.isnan(y[3])  # zeros and non-finite untouched
    d = bits(y[4:]) - bits(x[4:])
    assert bool((d.abs() == 1).all())  # one step of the bit pattern: one ulp, the sign kept
    assert bool((torch.sign(y[4:].float()) == torch.sign(x[4:].float())).all())
    moved = (y[4:].double() - x[4:].double()).abs() / x[4:].double().abs()
    eps = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[dtype]
    assert float(moved.max()) <= eps and float(moved.min()) >= eps / 4  # one ulp, relative 2^-p .. 2^-(p+1)
    assert 0.4 < float((d > 0).float().mean()) < 0.6  # up and down about equally


def test_fraction_and_seed():
    x = torch.randn(100_000).to(torch.bfloat16)
    a = lab_perturb.ulp_flip(x, 1e-2, torch.Generator().manual_seed(5))
    b = lab_perturb.ulp_flip(x, 1e-2, torch.Generator().manual_seed(5))
    c = lab_perturb.ulp_flip(x, 1e-2, torch.Generator().manual_seed(6))
    n = int((a != x).sum())
    assert 800 < n < 1200 and torch.equal(a, b) and not torch.equal(a, c)
    big = torch.tensor([torch.finfo(torch.bfloat16).max] * 64, dtype=torch.bfloat16)
    assert torch.isfinite(lab_perturb.ulp_flip(big, 1.0, torch.Generator().manual_seed(0))).all()
    with pytest.raises(TypeError, match="not bf16"):
        lab_perturb.ulp_flip(torch.zeros(3, dtype=torch.float64), 0.5, torch.Generator())


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 256, dtype=torch.bfloat16)
        self.proj = nn.Linear(256, 8, dtype=torch.bfloat16)

    def forward(self, ids):
        return self.proj(self.embed_tokens(ids))


class Top(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Model()

    def forward(self, ids):
        return self.model(ids)


def test_sglang_registers_it_on_the_embedding_and_its_output_replaces_the_embeddings(capsys):
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    torch.manual_seed(0)
    plain, hooked = Top(), Top()
    hooked.load_state_dict(plain.state_dict())
    register_forward_hooks(hooked, lab_perturb.perturb_spec(0.05, seed=3))
    ids = torch.arange(64)
    with torch.no_grad():
        e0 = plain.model.embed_tokens(ids)
        e1 = hooked.model.embed_tokens(ids)  # the hooked module's call returns the moved output
        e2 = hooked.model.embed_tokens(ids)  # the next call: another seed, other entries
    share = float((e1 != e0).float().mean())
    assert 0.03 < share < 0.07 and not torch.equal(e1, e2)
    assert bool(((bits(e1) - bits(e0)).abs() <= 1).all())
    err = capsys.readouterr().err
    assert err.count("lab_perturb: Embedding output moved one ulp in 0.05 of its entries") == 1  # said once
    again = Top()
    again.load_state_dict(plain.state_dict())
    register_forward_hooks(again, lab_perturb.perturb_spec(0.05, seed=3))
    with torch.no_grad():
        assert torch.equal(again.model.embed_tokens(ids), e1)  # same seed, same first call: the same entries


def test_spec_checks_the_fraction():
    for bad in (0.0, -1e-3, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            lab_perturb.perturb_spec(bad)
    spec = lab_perturb.perturb_spec(1e-4)[0]
    assert spec["target_modules"] == ["model.embed_tokens"] and spec["hook_factory"] == lab_perturb.FACTORY
