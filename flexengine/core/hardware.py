"""hardware=auto: find the device, its memory, its peak FLOP/s and the host memory a run may use.

Peak FLOP/s come from a table of vendor datasheet figures (dense bf16 tensor-core throughput, no 2:4 sparsity):
an unknown device gets `peak_tflops=None`, and the run reports no MFU rather than a wrong one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import torch

from flexengine.core.config import HardwareConfig
from flexengine.core.errors import UserError
from flexengine.core.units import GiB

log = logging.getLogger(__name__)

# (substring of torch.cuda.get_device_properties(i).name, dense bf16 TFLOP/s). First match wins, so the
# more specific names come first ("H100 PCIe" before "H100", "L40S" before "L40").
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("B200", 2250.0),  # NVIDIA B200 datasheet, dense bf16
    ("H200", 989.0),  # H200 SXM, same tensor cores as H100 SXM
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # H100 SXM5 ("NVIDIA H100 80GB HBM3")
    ("H800", 989.0),
    ("H20", 148.0),
    ("GH200", 989.0),
    ("A100", 312.0),  # A100 SXM4 and PCIe, 40 and 80 GB
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),  # AWS's A10G (g5), dense bf16
    ("A10", 125.0),
    ("RTX A6000", 155.0),
    ("RTX 6000 Ada", 364.0),
    ("MI300X", 1307.0),  # AMD Instinct (ROCm builds report it through torch.cuda)
    ("MI250X", 383.0),
]


def lookup_peak_tflops(device_name: str) -> Optional[float]:
    """Dense bf16 TFLOP/s of a known device name, else None (no MFU for unknown devices)."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key.lower() in device_name.lower()), None)


def available_host_memory_gb() -> float:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), in GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def resolve_device(name: str) -> torch.device:
    """hardware.device: auto -> cuda if available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("hardware.device=cuda but no CUDA device is visible; use hardware=auto or hardware=cpu.")
    return torch.device(name)


def resolve_hardware(hw: HardwareConfig, device: Optional[torch.device] = None) -> HardwareConfig:
    """A concrete HardwareConfig: device, memory budgets and peak FLOP/s filled in where they were left None.

    Memory budgets the user gave (or a named hardware/*.yaml) are capped by what this machine has: a config
    cannot promise memory that is not there. Planning without a device (`assumed_hardware`) keeps them."""
    device = device if device is not None else resolve_device(hw.device)
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    host_available = available_host_memory_gb() / local_ranks
    host_gb = _at_most(hw.host_memory_gb, host_available, "host_memory_gb")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = hw.name if hw.name != "auto" else props.name
        # a named card never above what this card reports: A100-80GB variants differ by 0.2 GiB
        memory_gb = _at_most(hw.memory_gb, props.total_memory / GiB, "memory_gb", tolerance=1.0)
        context_gb = hw.cuda_context_gb if hw.cuda_context_gb is not None else cuda_context_gb(device)
        peak = hw.peak_tflops if hw.peak_tflops is not None else lookup_peak_tflops(props.name)
        if peak is None:
            log.warning(
                "hardware: %r is not in flexengine.core.hardware.PEAK_BF16_TFLOPS; MFU is not reported "
                "(set hardware.peak_tflops to the device's dense bf16 TFLOP/s to get it)",
                props.name,
            )
    else:
        name = hw.name if hw.name != "auto" else "cpu"
        memory_gb = _at_most(hw.memory_gb, host_available, "memory_gb")  # the CPU's "device" is host memory
        context_gb = 0.0  # no CUDA context on a CPU run
        peak = hw.peak_tflops  # CPU peaks vary too much to tabulate: MFU only when given
    resolved = dataclasses.replace(
        hw,
        name=name,
        device=device.type,
        memory_gb=memory_gb,
        cuda_context_gb=context_gb,
        peak_tflops=peak,
        host_memory_gb=host_gb,
    )
    log.info(
        "hardware: %s (%s), %.2f GiB device memory (%.2f GiB of it held outside the allocator), %.1f GiB host "
        "memory, peak %s",
        name,
        device.type,
        memory_gb,
        context_gb,
        host_gb,
        "unknown (no MFU)" if peak is None else f"{peak:g} TFLOP/s",
    )
    return resolved


def cuda_context_gb(device: torch.device) -> float:
    """GiB of the device that the caching allocator cannot have: the CUDA context (0.5-0.8 GiB, created by this
    very call if it was not yet) and whatever other processes hold, i.e. total - free - what torch reserved."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device)) / GiB


def _at_most(given: Optional[float], measured: float, key: str, tolerance: float = 1.02) -> float:
    """The given figure unless it exceeds what was measured by more than `tolerance` (the yaml's rounding)."""
    if given is None:
        return measured
    if given > measured * tolerance:
        log.warning("hardware.%s=%g but this machine has %.2f GiB: planning with %.2f", key, given, measured, measured)
        return measured
    return given


def plans_this_machine(hw: HardwareConfig) -> bool:
    """Whether a plan of `hw` is for the device this process runs on (hardware=auto, a CPU, a card given by name
    without its memory): `assumed_hardware` resolves it here, and its speed can be measured. A named card
    (hardware=a100_80g) is planned from its datasheet wherever the plan runs."""
    return not (hw.on_cuda and hw.memory_gb is not None)


def assumed_hardware(hw: HardwareConfig) -> HardwareConfig:
    """The hardware a plan targets without touching any device: named configs as given, auto as this machine."""
    if not plans_this_machine(hw):
        return dataclasses.replace(
            hw, host_memory_gb=hw.host_memory_gb if hw.host_memory_gb is not None else available_host_memory_gb()
        )
    return resolve_hardware(hw)
