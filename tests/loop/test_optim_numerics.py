"""Long-horizon optimizer numerics (tests/support/optim_numerics.py): every precision mode's optimizer, driven for 3,000
steps while the gradient scale halves, steps like fp32 AdamW (0.9-1.1x its mean step over the last 500) exactly
when its PrecisionSpec says it trains correctly, at beta2 0.95 and 0.999. bf16_pure must fail the check, and so
must a bf16 second moment (the fault this check exists for): the check can fail."""

from __future__ import annotations

import pytest

from flexengine.surgery.precision import SPECS, optimizer_missing, precision_spec
from tests.support.optim_numerics import BETA2S, RATIO_BAND, Horizon, step_ratio, within_band

pytestmark = pytest.mark.slow  # 3,000 steps a case: minutes on 2 cores (the full run has them)

# every concrete mode with the optimizer it picks, plus adamw_8bit where a mode accepts it (torchao's 8-bit step
# compiled: eager it costs ~0.1 s a step on CPU; compiling costs a minute or two: slow)
CASES = [pytest.param(mode, "adamw", id=mode) for mode in SPECS] + [
    pytest.param(mode, "adamw_8bit", id=f"{mode}+adamw_8bit", marks=pytest.mark.slow) for mode in ("fp32", "bf16_pure")
]


@pytest.mark.parametrize("beta2", BETA2S)
@pytest.mark.parametrize("mode,optimizer", CASES)
def test_mode_steps_like_fp32_adamw_exactly_when_it_claims_to(mode, optimizer, beta2):
    spec = precision_spec(mode, optimizer)
    if optimizer_missing(spec.optimizer):
        pytest.skip(f"{spec.optimizer} needs {optimizer_missing(spec.optimizer)}")
    ratio = step_ratio(spec, beta2, Horizon(eager=optimizer != "adamw_8bit"))
    print(f"{mode} {spec.optimizer} beta2={beta2}: mean step {ratio:.3f}x fp32 AdamW's")
    assert within_band(ratio) == spec.trains_correctly, (
        f"{mode} ({spec.optimizer}) at beta2={beta2}: mean step {ratio:.3f}x fp32 AdamW's over the last steps "
        f"(band {RATIO_BAND}), but trains_correctly={spec.trains_correctly}"
    )


def test_bf16_pure_never_trains_correctly():
    assert not SPECS["bf16_pure"].trains_correctly
    assert all(SPECS[m].trains_correctly for m in SPECS if m != "bf16_pure")


def test_a_bf16_second_moment_fails_the_check(monkeypatch):
    """torchao's own storage (exp_avg_sq in bf16, round-to-nearest) at beta2 0.999: v cannot fall with the
    gradient scale, the steps end ~0.8x fp32's. This is what adamw_bf16 shipped with before its fp32 v."""
    pytest.importorskip("torchao")
    from torchao.optim import _AdamW

    from flexengine.loop.adamw_bf16 import AdamWBF16

    monkeypatch.setattr(AdamWBF16, "_new_buffer", _AdamW._new_buffer)
    ratio = step_ratio(SPECS["bf16_sr"], 0.999)
    assert ratio < RATIO_BAND[0], ratio
