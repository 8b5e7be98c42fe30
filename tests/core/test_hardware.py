"""hardware=auto: device name, memory and peak FLOP/s found at run time; unknown devices get no MFU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flexengine.core.config import HardwareConfig
from flexengine.core.errors import UserError
from flexengine.core.hardware import available_host_memory_gb, lookup_peak_tflops, resolve_hardware
from flexengine.core.units import GiB


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("Tesla V100-SXM2-16GB", None),
        ("Some Future GPU", None),
    ],
)
def test_peak_table_matches_specific_names_first(name, tflops):
    assert lookup_peak_tflops(name) == tflops


def test_auto_on_cpu_uses_host_memory_and_reports_no_mfu():
    hw = resolve_hardware(HardwareConfig(), device=torch.device("cpu"))
    assert hw.device == "cpu" and hw.name == "cpu" and hw.peak_tflops is None
    assert 0 < hw.memory_gb <= available_host_memory_gb() * 1.5 and hw.host_memory_gb == pytest.approx(hw.memory_gb)


def test_auto_on_cuda_reads_device_properties(monkeypatch):
    props = SimpleNamespace(name="NVIDIA H200", total_memory=150_121_218_048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    # the context (and other processes) hold what is neither free nor reserved by torch's allocator
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (props.total_memory - GiB, props.total_memory))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: GiB // 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    hw = resolve_hardware(HardwareConfig(host_memory_gb=None), device=torch.device("cuda", 0))
    assert hw.name == "NVIDIA H200" and hw.device == "cuda"
    assert hw.memory_gb == pytest.approx(150_121_218_048 / GiB) and hw.peak_tflops == 989.0
    assert hw.cuda_context_gb == pytest.approx(0.75)
    assert hw.host_memory_gb == pytest.approx(available_host_memory_gb() / 8, rel=0.2)  # a share per local rank
    unknown = SimpleNamespace(name="Mystery Accelerator", total_memory=48 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: unknown)
    assert resolve_hardware(HardwareConfig(), device=torch.device("cuda", 0)).peak_tflops is None
    # a named config cannot promise memory the machine does not have
    capped = resolve_hardware(
        HardwareConfig(name="a100_80g", device="cuda", memory_gb=79.3, host_memory_gb=1e6),
        device=torch.device("cuda", 0),
    )
    assert capped.memory_gb == pytest.approx(48) and capped.host_memory_gb < 1e6
    # ... not even by the 0.2 GiB the A100-80GB variants differ by; a measured context the user gave is kept
    props80 = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", total_memory=int(79.2 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props80)
    a100 = resolve_hardware(
        HardwareConfig(name="a100_80g", device="cuda", memory_gb=79.3, cuda_context_gb=0.6),
        device=torch.device("cuda", 0),
    )
    assert a100.memory_gb == pytest.approx(79.2) and a100.cuda_context_gb == 0.6


def test_given_values_are_kept():
    hw = resolve_hardware(
        HardwareConfig(name="mine", memory_gb=2, peak_tflops=1.5, host_memory_gb=1), device=torch.device("cpu")
    )
    assert (hw.name, hw.memory_gb, hw.peak_tflops, hw.host_memory_gb) == ("mine", 2, 1.5, 1)


def test_bad_values_name_the_key():
    with pytest.raises(UserError, match="hardware.memory_gb"):
        HardwareConfig(memory_gb=0)
    with pytest.raises(UserError, match="hardware.device"):
        HardwareConfig(device="tpu")


def test_the_hardware_line_gives_a_unit_only_to_a_number(caplog):
    """Before: `peak unknown (no MFU) TFLOP/s` -- the unit followed the words that said there was no number."""
    with caplog.at_level("INFO", logger="flexengine.core.hardware"):
        resolve_hardware(HardwareConfig(), device=torch.device("cpu"))
        resolve_hardware(HardwareConfig(peak_tflops=1.5), device=torch.device("cpu"))
    unknown, given = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hardware:")]
    assert unknown.endswith("peak unknown (no MFU)") and "TFLOP/s" not in unknown
    assert given.endswith("peak 1.5 TFLOP/s")
