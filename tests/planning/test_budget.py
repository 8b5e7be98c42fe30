"""The device budget: the card less the CUDA context and a named fragmentation margin."""

from __future__ import annotations

import pytest

from flexengine.core.config import HardwareConfig
from flexengine.core.units import GiB
from flexengine.planning.budget import (
    ASSUMED_CUDA_CONTEXT_BYTES,
    DeviceBudget,
    default_margin_bytes,
    device_budget,
)


@pytest.mark.parametrize("card_gib,margin_gib", [(24, 3.0), (40, 3.0), (79.15, 0.05 * 79.15), (139.8, 0.05 * 139.8)])
def test_default_margin_is_five_percent_with_a_three_gib_floor(card_gib, margin_gib):
    assert default_margin_bytes(int(card_gib * GiB)) == pytest.approx(margin_gib * GiB, rel=1e-6)


def test_a_named_card_without_a_device_assumes_the_context_and_takes_the_default_margin():
    budget = device_budget(HardwareConfig(name="a100_80g", device="cuda", memory_gb=79.15))
    assert budget.card_bytes == int(79.15 * GiB) and budget.context_bytes == ASSUMED_CUDA_CONTEXT_BYTES
    assert budget.margin_bytes == int(0.05 * 79.15 * GiB)
    assert budget.usable_bytes == budget.card_bytes - budget.context_bytes - budget.margin_bytes
    assert budget.describe() == "79.15 GiB card - 0.80 context - 3.96 margin = 74.39 GiB budget"


def test_measured_context_and_given_margin_are_used_as_they_are():
    hw = HardwareConfig(name="h200", device="cuda", memory_gb=139.8, cuda_context_gb=0.55, memory_margin_gb=0)
    budget = device_budget(hw)
    assert (budget.context_bytes, budget.margin_bytes) == (int(0.55 * GiB), 0)
    assert budget.usable_bytes == int(139.8 * GiB) - int(0.55 * GiB)


def test_a_cpu_device_is_host_memory_without_context_or_margin():
    budget = device_budget(HardwareConfig(name="cpu", device="cpu", memory_gb=16))
    assert budget == DeviceBudget(16 * GiB, 0, 0) and budget.describe() == "16.00 GiB budget"
    with_margin = device_budget(HardwareConfig(name="cpu", device="cpu", memory_gb=16, memory_margin_gb=1))
    assert with_margin.usable_bytes == 15 * GiB


def test_negative_settings_name_the_key():
    from flexengine.core.errors import UserError

    with pytest.raises(UserError, match="hardware.memory_margin_gb"):
        HardwareConfig(memory_margin_gb=-1)
    with pytest.raises(UserError, match="hardware.cuda_context_gb"):
        HardwareConfig(cuda_context_gb=-0.5)
