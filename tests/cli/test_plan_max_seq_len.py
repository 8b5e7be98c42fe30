"""plan.max_seq_len's per-mode table: every (LoRA rank, mode) row, and per rank the longest a mode that trains
correctly reaches, with its policy and what the host holds (the search itself: tests/planning/test_max_seq_len.py)."""

from __future__ import annotations

from flexengine.cli.plan_max_seq_len import format_longest_over_modes
from flexengine.core.units import GiB


def _row(r: int, mode: str, n: int, ok: bool = True, host: float = 10.0, offloaded: float = 4.0) -> dict:
    return {
        "lora_r": r,
        "precision": mode,
        "trains_correctly": ok,
        "max_seq_len": n,
        "total_bytes": 70 * GiB,
        "host_bytes": host * GiB,
        "offloaded_bytes": offloaded * GiB,
        "step_s": 100.0,
        "policy": "full + offload",
    }


def test_the_longest_per_rank_skips_modes_that_do_not_train_correctly():
    rows = [_row(0, "bf16_sr", 50_000), _row(0, "bf16_pure", 90_000, ok=False), _row(0, "bf16_cpu_master", 80_000)]
    rows += [_row(16, "bf16_mixed", 0), _row(16, "bf16_cpu_master", 300_000, host=80.0, offloaded=79.5)]
    text = format_longest_over_modes(rows)
    assert "longest, full fine-tune: 80,000 tokens with precision=bf16_cpu_master and full + offload" in text
    assert "the host holds 10.0 GiB (6.0 GiB of optimizer state and masters, 4.0 GiB of offloaded" in text
    assert "longest, LoRA r=16: 300,000 tokens" in text and "(not even 128 tokens fit)" in text
    assert "fails the long-horizon numerics check" in text  # bf16_pure shown, not taken
