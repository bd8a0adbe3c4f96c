"""The gate's GPU interconnect: NVLink or PCIe between the visible GPUs, read through NVML, and SGLang's custom
all-reduce turned off at launch unless NVLink joins every pair.

NVML is the driver's library, so a stand-in module answers for it here (built on pynvml's own constants and error
classes); SGLang is the real 0.5.16.
"""

import argparse
import dataclasses

import pynvml
import pytest

from dsv4_sm80 import gate
from dsv4_sm80.gate import Facts, GpuFacts, InterconnectFacts, PatchFacts, SGLangFacts

BUS = ["00000000:4F:00.0", "00000000:52:00.0", "00000000:D6:00.0", "00000000:DA:00.0"]


def gpus(n=4):
    return GpuFacts(devices=[{"index": i, "name": "NVIDIA A800 80GB PCIe", "cc": "8.0", "memory_gib": 79.3,
                              "pci_bus_id": BUS[i]} for i in range(n)])


class FakeNvml:
    """NVML as a box with the NVLink pairs `nvlink` (sets of visible indices) and `links` active NVLinks per
    GPU; `fail` names a call that raises an NVML error."""
    NVMLError = pynvml.NVMLError
    NVML_P2P_CAPS_INDEX_NVLINK = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED

    def __init__(self, nvlink=(), links=None, fail=None):
        self.nvlink = {frozenset(BUS[i] for i in pair) for pair in nvlink}
        self.links = links or {}
        self.fail = fail
        self.open = 0

    def _maybe_fail(self, call, code=pynvml.NVML_ERROR_UNKNOWN):
        if self.fail == call:
            raise pynvml.NVMLError(code)

    def nvmlInit(self):
        self._maybe_fail("init", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self._maybe_fail("handle", pynvml.NVML_ERROR_NOT_FOUND)
        return bus

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        self._maybe_fail("p2p", pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_P2P_STATUS_OK if {a, b} in self.nvlink else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetNvLinkState(self, handle, link):
        n = self.links.get(BUS.index(handle), 0)
        if n == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a GPU without NVLink
        if link >= n:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # past its last link
        return pynvml.NVML_FEATURE_ENABLED


ALL_PAIRS = [(i, j) for i in range(4) for j in range(i + 1, 4)]


def judge(nvml, n=4):
    """(the interconnect facts, the gpu.interconnect finding, the launch's server arguments)."""
    f = gate.collect_interconnect(gpus(n), nvml)
    assert getattr(nvml, "open", 0) == 0  # every nvmlInit met its nvmlShutdown
    facts = Facts(sglang=SGLangFacts(), gpus=gpus(n), patch=PatchFacts(), model=gate.collect_model(None),
                  interconnect=f)
    finding = next(x for x in gate.evaluate(facts) if x.check == "gpu.interconnect")
    assert "\n" not in finding.line() and "Traceback" not in finding.line()
    return f, finding, gate.interconnect_launch_args(f)


def test_all_nvlink_keeps_custom_all_reduce():
    f, finding, args = judge(FakeNvml(nvlink=ALL_PAIRS, links={i: 8 for i in range(4)}))
    assert f.error is None and len(f.pairs) == 6 and all(p["nvlink"] for p in f.pairs) and f.links == [8] * 4
    assert finding.line() == ("PASS gpu.interconnect: 4 GPUs, NVLink between all pairs (8 active NVLinks per GPU): "
                              "SGLang's custom all-reduce on")
    assert args == {}


def test_all_pcie_turns_custom_all_reduce_off():
    f, finding, args = judge(FakeNvml())
    assert not any(p["nvlink"] for p in f.pairs) and f.links == [0] * 4
    line = finding.line()
    assert line.startswith("WARN gpu.interconnect: no NVLink between any of the 4 GPUs (PCIe only): SGLang's custom "
                           "all-reduce turned off (the launch sets --disable-custom-all-reduce; SGLang 0.5.16 also "
                           "turns it off above two GPUs"), line
    assert "custom_all_reduce_utils.py:465" in line and "NCCL over PCIe" in line
    assert args == {"disable_custom_all_reduce": True}


def test_two_nvlink_pairs_over_pcie_turn_it_off():
    """PCIe cards with NVLink bridges in pairs: not every pair is joined, so the custom all-reduce is off."""
    f, finding, args = judge(FakeNvml(nvlink=[(0, 1), (2, 3)], links={i: 4 for i in range(4)}))
    assert finding.status == "warn"
    assert finding.found.startswith("GPU 0-2, 0-3, 1-2, 1-3 PCIe only (NVLink: 0-1, 2-3): SGLang's custom all-reduce "
                                    "turned off"), finding.found
    assert args == {"disable_custom_all_reduce": True}


def test_two_pcie_gpus_turn_it_off_where_sglang_would_not():
    f, finding, args = judge(FakeNvml(), n=2)
    assert f.pairs == [{"a": 0, "b": 1, "nvlink": False}]
    assert finding.found.startswith("no NVLink between any of the 2 GPUs (PCIe only): SGLang's custom all-reduce "
                                    "turned off (the launch sets --disable-custom-all-reduce; SGLang 0.5.16 would "
                                    "keep it on two PCIe GPUs"), finding.found
    assert args == {"disable_custom_all_reduce": True}


def test_two_nvlink_gpus_and_one_gpu():
    _, finding, args = judge(FakeNvml(nvlink=[(0, 1)], links={0: 12, 1: 8}), n=2)
    assert finding.found == ("2 GPUs, NVLink between all pairs (active NVLinks per GPU: 12, 8): SGLang's custom "
                             "all-reduce on") and args == {}
    _, finding, args = judge(FakeNvml(), n=1)
    assert finding.line() == "PASS gpu.interconnect: 1 GPU: no all-reduce between GPUs" and args == {}


def test_an_nvml_error_on_a_pair_reads_as_no_nvlink():
    """SGLang's own reading (custom_all_reduce_utils.py:385-390): GPUs without NVLink may answer with an error."""
    f, finding, args = judge(FakeNvml(nvlink=ALL_PAIRS, fail="p2p"))
    assert f.error is None and not any(p["nvlink"] for p in f.pairs)
    assert finding.status == "warn" and args == {"disable_custom_all_reduce": True}


@pytest.mark.parametrize("fail, phrase", [("init", "NVML unavailable (NVMLError_DriverNotLoaded"),
                                          ("handle", "NVML query failed (NVMLError_NotFound")])
def test_nvml_failing_leaves_the_interconnect_unknown(fail, phrase):
    f, finding, args = judge(FakeNvml(nvlink=ALL_PAIRS, fail=fail))
    assert f.pairs == [] and phrase in f.error
    assert finding.status == "warn" and finding.found.startswith(f"unknown ({phrase}")
    assert "--disable-custom-all-reduce" in finding.found and "nvidia-smi topo -m" in finding.found
    assert args == {"disable_custom_all_reduce": True}


class _NoNvml:
    def nvmlInit(self):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")


def test_no_nvml_library_no_gpu_and_no_bus_id_are_warnings():
    _, finding, args = judge(_NoNvml())
    assert finding.found.startswith("unknown (NVML unavailable (OSError: libnvidia-ml.so.1") and args
    f = gate.collect_interconnect(GpuFacts(error="libcuda.so.1 cannot be loaded"), FakeNvml())
    assert gate.check_interconnect(f).found.startswith("unknown (libcuda.so.1 cannot be loaded)")
    no_bus = GpuFacts(devices=[{k: v for k, v in d.items() if k != "pci_bus_id"} for d in gpus().devices])
    assert "no PCI bus id" in gate.check_interconnect(gate.collect_interconnect(no_bus, FakeNvml())).found


def test_the_real_pynvml_never_raises():
    """This machine's own NVML (none on a CPU machine; on a GPU machine the made-up bus ids are not found)."""
    f = gate.collect_interconnect(gpus())
    assert f.error and gate.check_interconnect(f).status == "warn"


def test_not_collected_is_skipped():
    assert gate.check_interconnect(None).status == "skip"
    assert gate.interconnect_launch_args(InterconnectFacts(gpus=4, error="x")) == {"disable_custom_all_reduce": True}


def test_sglang_server_args_have_the_field_the_launch_sets():
    from sglang.srt.server_args import ServerArgs

    field = {f.name: f for f in dataclasses.fields(ServerArgs)}["disable_custom_all_reduce"]
    assert field.default is False
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "m", "--disable-custom-all-reduce"]).disable_custom_all_reduce is True


def test_the_launch_seam_sets_the_argument_and_prints_the_warning(monkeypatch, capsys):
    """The launch stage (seam launch.gate) applies the launch arguments of the facts it collected and says so."""
    from types import SimpleNamespace

    from dsv4_sm80.stages.launch import gate_and_set_args

    for nvml, want in ((FakeNvml(), True), (FakeNvml(nvlink=ALL_PAIRS, links={i: 8 for i in range(4)}), False)):
        f = gate.collect_interconnect(gpus(), nvml)
        facts = Facts(sglang=SGLangFacts(), gpus=gpus(), patch=PatchFacts(), model=gate.collect_model(None),
                      interconnect=f)
        found = (facts, [gate.check_interconnect(f)])
        monkeypatch.setattr(gate, "run_gate", lambda *a, _found=found, **k: _found)
        args = SimpleNamespace(model_path="/model", disable_custom_all_reduce=False)
        assert gate_and_set_args(None, args) is None
        assert args.disable_custom_all_reduce is want
        assert (args.moe_runner_backend, args.kv_cache_dtype) == ("marlin", "bfloat16")  # the stages' rules
        err = capsys.readouterr().err
        assert ("dsv4-sm80: WARN gpu.interconnect: no NVLink" in err) is want
        assert ("disable_custom_all_reduce False -> True" in err) is want
        assert "dsv4-sm80 launch: moe_runner_backend None -> marlin, kv_cache_dtype None -> bfloat16" in err


def test_mscclpp_cannot_run_at_the_products_four_ranks():
    """The gate guards only the custom all-reduce: SGLang's MSCCL++ all-reduce refuses world sizes below 8."""
    from sglang.srt.distributed.device_communicators.pymscclpp import PyMscclppCommunicator

    assert 4 not in PyMscclppCommunicator._SUPPORTED_WORLD_SIZES
    assert min(PyMscclppCommunicator._SUPPORTED_WORLD_SIZES) > 4
