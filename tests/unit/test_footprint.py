"""The memory arithmetic (dsv4_sm80/footprint.py) against the published parameter counts and SGLang's own pool
sizing."""

import pytest

from conftest import last_json, run_python
from dsv4_sm80 import footprint as fp
from dsv4_sm80.checkpoint import format as fmt
from dsv4_sm80.stages import launch

GIB = 2 ** 30


def per_part(config, dense, tp=4):
    return {p: round(sum(c.values()) / GIB, 2) for p, c in fp.weights(config, tp, dense).items()}


def test_weights_per_gpu_match_the_published_arithmetic():
    """TP4 (docs/footprint.md): checkpoint-native 37.24 (main) / 2.68 (DSPARK) / 0.87 (vision) GiB per
    card; BF16 linears with MXFP4 + E8M0 experts 38.91 / 2.83 / 0.87."""
    vl = fmt.vision_exp_config()
    assert per_part(vl, "native") == {"main": 37.24, "draft": 2.68, "vision": 0.87}
    assert per_part(vl, "bf16") == {"main": 38.91, "draft": 2.83, "vision": 0.87}
    assert per_part(fmt.flash_0731_config(), "bf16") == {"main": 38.91, "draft": 2.83}
    marlin = per_part(vl, "fp8_marlin")
    extra = per_part(vl, "bf16")["main"] + per_part(vl, "bf16")["draft"] - marlin["main"] - marlin["draft"]
    assert 1.3 < extra < 1.5  # docs/dense.md: BF16 costs about 1.3-1.4 GiB per GPU more at TP4
    # the experts are 4-bit 34.27 GiB (277.03 B params x 4.25 bits / 4 cards)
    assert round(fp.weights(vl, 4, "bf16")["main"]["experts"] / GIB, 2) == 34.27
    # nothing large falls through to the catch-all
    assert all(c.get("norms", 0) < 0.01 * GIB for c in fp.weights(vl, 4, "bf16").values())


def test_tp_sharding_rules():
    spec = lambda name, shape, dtype="F8_E4M3": fmt.TensorSpec(name, dtype, shape, "", 1)  # noqa: E731
    assert fp.resident_bytes(spec("layers.0.attn.wq_b.weight", (4096, 1024)), "bf16", 4) == 4096 * 1024 * 2 / 4
    assert fp.resident_bytes(spec("layers.0.attn.wq_a.weight", (1024, 4096)), "bf16", 4) == 1024 * 4096 * 2
    assert fp.resident_bytes(spec("layers.0.attn.wo_a.weight", (8192, 4096)), "fp8_marlin", 4) == 8192 * 4096 * 2 / 4
    assert fp.resident_bytes(spec("mtp.0.main_proj.weight", (4096, 12288)), "fp8_marlin", 4) == 4096 * 12288 * 2
    assert fp.resident_bytes(spec("layers.0.attn.wq_b.scale", (32, 8), "F8_E8M0"), "bf16", 4) == 0
    assert fp.resident_bytes(spec("layers.0.ffn.experts.5.w2.scale", (4096, 64), "F8_E8M0"), "bf16", 4) == 4096 * 64 / 4


SIZING = """
import json
from types import SimpleNamespace
import sglang.srt.model_executor.pool_configurator as pc
fn = pc.DSV4PoolConfigurator._get_bytes_per_full_token
out = {}
for ring in (8, 16):
    g = SimpleNamespace(qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, c4_ring_size=ring,
                        swa_page_size=128, c4_shrink_factor=1, swa_ratio=0.1, num_layers_total=43,
                        num_layers_ca4=21, num_layers_ca128=20)
    out[ring] = fn(g)
print(json.dumps(out))
"""


@pytest.mark.sglang
def test_kv_per_token_is_sglangs_patched_sizing():
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    sglang = last_json(run_python(SIZING, ENABLE_SGLANG_DSV4_A100_PATCH="1"))
    for ring in (8, 16):
        ours = fp.KVGeometry.of(fmt.flash_0731_config(), c4_ring=ring).per_full_token()
        assert ours == pytest.approx(sglang[str(ring)], rel=1e-12), (ring, ours, sglang)
    geo = fp.KVGeometry.of(fmt.flash_0731_config())
    assert (geo.layers, geo.c4_layers, geo.c128_layers) == (43, 21, 20)
    assert geo.intrinsic_per_token() == 6229.0  # BF16 KV + INT8 indexer (docs/footprint.md)


def test_512k_fits_on_four_a800s():
    """With the draft, the vision tower, speculative rings and the reserves, each 80 GB card keeps room for
    more than one 512K request in both dense modes (every rank stores the whole KV)."""
    for dense in ("bf16", "fp8_marlin"):
        p = fp.plan(fmt.vision_exp_config(), tp=4, dense=dense)
        assert p.kv_per_full_token == pytest.approx(13630.0, abs=0.05)  # spec + draft (docs/footprint.md)
        assert p.concurrency > 3, (dense, p.concurrency)
    # and it would not at TP2: the weights alone outgrow the card
    assert fp.plan(fmt.vision_exp_config(), tp=2).concurrency == 0


def test_footprint_cli():
    import contextlib
    import io

    from dsv4_sm80.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["footprint"]) == 0
    text = buf.getvalue()
    assert "== DeepSeek-V4-Flash-Vision-Exp" in text and "vision   0.87 GiB" in text
    assert "13,630.0 B per pool token" in text and "requests of 524,288 tokens" in text


@pytest.mark.sglang
def test_startup_report_counts_weights_pool_and_graphs(capsys):
    """The start-up line's pieces on real objects: a module with vision-named parameters (shared storage
    counted once) and a real SGLang pool built on the CPU; errors never fail a start."""
    pytest.importorskip("sglang", reason="CI installs sglang==0.5.16; this check needs it")
    import types

    import torch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(1024, 256)  # 1 MiB fp32
    model.vision = torch.nn.Linear(512, 512, bias=False)  # 1 MiB
    model.tied = model.embed  # the same storage twice
    assert launch.model_bytes(model) == {"weights": 2 ** 20, "vision": 2 ** 20}  # the text part, vision apart
    model.vision_part = torch.nn.Linear(256, 256, bias=False)  # where the VL class holds its vision part
    assert launch.model_bytes(model) == {"weights": 2 ** 20, "vision": 2 ** 20 + 2 ** 18}
    del model.vision_part
    pool = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
    table = pool.req_to_token.numel() * pool.req_to_token.element_size()
    assert table <= launch._unique_bytes(launch.tensors_of(pool), set()) < table + 4096  # + its small free-slot list
    runner = types.SimpleNamespace(model=model, token_to_kv_pool=pool, graph_mem_usage=1.25,
                                   max_total_num_tokens=4096, is_draft_worker=True, tp_rank=2)
    line = launch.startup_line(runner)
    assert line.startswith("[rank 2] dsv4-sm80 footprint (draft): weights 0.00 GiB (+ vision 1.0 MiB), KV pool")
    assert "(4,096 tokens), CUDA graphs 1.25 GiB" in line  # SGLang's figure is in 2^30 bytes
    launch.log_footprint(None, types.SimpleNamespace())  # nothing to report: a message, not an exception
    assert "dsv4-sm80 footprint: not available (AttributeError" in capsys.readouterr().err


def test_startup_report_names_the_moe_expand_workspace():
    """The W4A8 expanded path's workspace (a transient of prefill forwards above 8192 tokens) in the start-up line:
    its size at TP4 shapes from the layer's own repacked weight (256 experts, gate-up [1024, 4096]: 128 experts a
    share of 512 MiB, plus 4 KiB of row map each), and whether the server's chunked prefill size lets a forward reach
    it; absent where no layer can take that path."""
    import types

    import torch

    from dsv4_sm80.kernels.w4a8_moe import expand_share
    from dsv4_sm80.stages.moe import W4A8Layer

    assert expand_share(256, 1024, 4096) == (128, 128 * 1024 * 4096, 128 * 4096)
    assert expand_share(2, 1024, 4096) == (2, 2 * 1024 * 4096, 2 * 4096)  # fewer experts than a share
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.w13_weight = torch.nn.Parameter(torch.empty((256, 1024, 2048), dtype=torch.uint8, device="meta"),
                                                  requires_grad=False)

    def runner(chunk):
        return types.SimpleNamespace(model=model, server_args=types.SimpleNamespace(chunked_prefill_size=chunk))

    assert launch.expand_workspace(runner(16384)) == ""  # no layer marked: nothing to name
    model.experts.dsv4_w4a8 = W4A8Layer(torch.ones(1, 1), torch.ones(1, 1), expand_ok=True, repack_seconds=0.0)
    assert launch.expand_workspace(runner(8192)) == ("MoE expand workspace 0.50 GiB transient, not reached: chunked "
                                                 "prefill 8,192")
    assert launch.expand_workspace(runner(16384)) == ("MoE expand workspace 0.50 GiB transient, reached by prefill "
                                                  "forwards above 8,192 tokens (chunked prefill 16,384)")
    assert launch.expand_workspace(runner(-1)).endswith("above 8,192 tokens (chunked prefill off)")
