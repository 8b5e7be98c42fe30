"""The doctor's time checks on numbers built by hand: a step within a quarter of its plan, one beyond it with the
likely term named, an unknown speed, and the epoch at the measured step."""

from __future__ import annotations

from flexengine.cli.doctor_time import epoch_check, likely_term, step_time_check
from flexengine.core.config import JobConfig


def _time_numbers(measured: float, planned: float, source: str = "measured device speed", **phases) -> dict:
    split = {"data": 0.0, "mask": 0.0, "forward": 0.3, "backward": 0.6, "optimizer": 0.1, "other": 0.0} | phases
    terms = {"matmul": 0.6, "attention": 0.1, "pointwise": 0.1, "loss": 0.0, "recompute": 0.0, "optimizer": 0.1}
    return {
        "step_time": {
            "measured_s": measured,
            "planned_s": planned,
            "planned_source": source,
            "ratio": measured / planned,
            "planned_terms_s": terms | {"exposed_transfers": 0.0},
            "phases_s": split,
            "steps_per_epoch": 1_000,
            "epoch_s": 1_000 * measured,
        }
    }


def test_a_step_within_a_quarter_of_the_plan_is_ok_and_beyond_it_names_the_term():
    job = JobConfig()
    assert step_time_check(job, _time_numbers(1.1, 1.0))["verdict"] == "ok"
    slow_optimizer = step_time_check(job, _time_numbers(1.5, 1.0, optimizer=0.6))
    assert slow_optimizer["verdict"] == "warn" and "the optimizer step" in slow_optimizer["detail"]
    host = step_time_check(job, _time_numbers(1.5, 1.0, other=0.5))
    assert "host syncs" in host["detail"] and "slower" in host["detail"]
    unknown = step_time_check(job, _time_numbers(5.0, 1.0, source="unknown device speed"))
    assert unknown["verdict"] == "info" and "unknown device speed" in unknown["value"]
    epoch = epoch_check(job, _time_numbers(1.8, 1.0))
    assert "30.0 min per epoch" in epoch["value"] and "1,000 steps" in epoch["value"]


def test_compute_beyond_its_plan_names_recompute_attention_or_the_matmuls():
    numbers = _time_numbers(2.0, 1.0, backward=1.5)["step_time"]
    assert likely_term(numbers).startswith("the matmuls")
    numbers["planned_terms_s"]["recompute"] = 0.3
    assert likely_term(numbers) == "recompute"
    numbers["planned_terms_s"]["exposed_transfers"] = 0.1
    assert likely_term(numbers).startswith("exposed transfers")
