"""The run's speed figures: rates are of training time, and a launch that trains nothing reports no rate of its own."""

from __future__ import annotations

import json
import logging

import pytest

from flexengine.run import run_training
from tests.helpers import DEBUG_FAST, make_job


def test_resuming_a_finished_run_reports_the_runs_rate_not_tokens_over_nothing(tmp_path, caplog):
    """train.save_every at the last step left the final save out, and that checkpoint recorded 0 s of training (the
    loop's time was added after it): resuming the finished run divided every token by 1e-9 (2179774108 useful
    tokens/s). The checkpoint now records the loop's time so far; the resumed launch says it ran no step."""
    out = tmp_path / "run"
    first = run_training(make_job(out, *DEBUG_FAST, "train.max_steps=2", "train.save_every=2"), out)
    assert first["steps_run"] == 2 and first["useful_tokens_per_s"] > 0
    with caplog.at_level(logging.INFO, logger="flexengine.run"):
        again = run_training(
            make_job(out, *DEBUG_FAST, "train.max_steps=2", "train.save_every=2", "train.resume=auto"), out
        )
    assert again["steps"] == 2 and again["steps_run"] == 0
    assert 0 < again["train_s"] <= first["train_s"]  # the time up to the last step's save, not 0
    rate = again["useful_tokens_per_s"]
    assert rate == again["useful_tokens_seen"] / again["train_s"] and rate < 3 * first["useful_tokens_per_s"]
    assert "done: no step run by this launch (it resumed at step 2); the run so far: 2 steps" in caplog.text
    assert json.loads((out / "summary.json").read_text())["steps_run"] == 0


def test_no_training_time_means_no_rate(tmp_path, monkeypatch):
    """A trainer that has not trained yet has 0 s of training: no rate, and the line says why."""
    from flexengine.loop import progress
    from flexengine.run import build_trainer, done_line

    out = tmp_path / "run"
    trainer = build_trainer(make_job(out, *DEBUG_FAST, "train.max_steps=1"), out)
    summary = trainer.summary()  # nothing trained yet: train_s is 0
    assert summary["tokens_per_s"] is None and summary["useful_tokens_per_s"] is None and summary["mfu"] is None
    assert "no training time recorded" in done_line(summary, out / "summary.json")
    assert (
        progress.hparam_metrics(summary)["useful_tokens_per_s"]
        != progress.hparam_metrics(summary)["useful_tokens_per_s"]
    )  # NaN for TensorBoard's HPARAMS


def test_the_run_clock_leaves_pauses_out_of_training_time(monkeypatch):
    """Progress's clock on a fake timer: evaluations and samples inside the loop are not training time (train_s, the
    mean step time behind the ETA), an evaluation is left out of the log window's rates too, wall_s counts it all,
    and a resumed run's times carry on."""
    import torch

    from flexengine.core.config import TrainConfig
    from flexengine.loop import progress
    from flexengine.loop.state import TrainState

    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.Progress(TrainConfig(max_steps=10), TrainState(), peak_tflops=None)
    clock.restore(wall_s=50.0, train_s=40.0)  # the first launch's
    clock.start_run()
    clock.start_loop(step=4)
    now[0] += 6.0  # two steps of 3 s
    clock.pause(4.0)  # then a 4 s evaluation
    now[0] += 4.0
    clock.exclude_last_pause()
    assert clock.mean_step_s(6) == 3.0 and clock.steps_run(6) == 2
    assert clock.elapsed_train() == 40.0 + 6.0 and clock.elapsed_wall() == 50.0 + 10.0
    logged = {}

    class Metrics:
        def scalars(self, values, step):
            logged.update(values)

    clock.count({"tokens": 60, "useful_tokens": 30, "model_flops": 0.0, "hardware_flops": 0.0})
    m = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 30, "useful_tokens": 15, "block_density": None}
    clock.log_step(Metrics(), m, 6, eta_s=0.0, device=torch.device("cpu"))
    assert logged["tokens_per_s"] == 60 / 6.0  # the window's rates divide by the training seconds only
    clock.end_loop()
    now[0] += 5.0  # the final save: wall time, not training
    assert clock.train_s == 46.0 and clock.elapsed_train() == 46.0 and clock.elapsed_wall() == 65.0


def test_the_step_time_report_holds_the_plan_to_account(monkeypatch):
    """Each step from start_step to count; the median leaves the warm-up step out (two under compile), the ratio
    is measured / planned, TensorBoard gets the step, the plan and the ratio so far."""
    import torch

    from flexengine.core.config import TrainConfig
    from flexengine.loop import progress
    from flexengine.loop.state import TrainState

    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.Progress(TrainConfig(max_steps=10), TrainState(), peak_tflops=None)
    assert clock.step_time_report()["measured_s"] is None and clock.step_time_report()["ratio"] is None
    clock.planned = progress.PlannedStep(2.0, "measured device speed", None, {"matmul": 1.5, "optimizer": 0.5})
    clock.start_loop(0)
    logged = {}

    class Metrics:
        def scalars(self, values, step):
            logged.update(values)

    m = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8, "useful_tokens": 8, "block_density": None}
    for seconds in (9.0, 2.0, 3.0, 2.5):  # the first step warms up
        clock.start_step()
        now[0] += seconds
        clock.count({**m, "model_flops": 0.0, "hardware_flops": 0.0})
        clock.log_step(Metrics(), m, len(clock.step_times), eta_s=0.0, device=torch.device("cpu"))
    report = clock.step_time_report()
    assert report["measured_s"] == 2.5 and report["excluded_first_steps"] == 1 and report["measured_steps"] == 3
    assert (
        report["ratio"] == 1.25 and report["planned_s"] == 2.0 and report["planned_source"] == "measured device speed"
    )
    assert report["planned_terms_s"] == {"matmul": 1.5, "optimizer": 0.5}
    assert logged["step_s"] == 2.5 and logged["planned_step_s"] == 2.0 and logged["step_time_ratio"] == 1.25
    assert progress.warmup_steps(compiled=True) == 2


def test_an_unknown_planned_speed_gives_no_ratio_and_compiled_blocks_skip_two_steps(monkeypatch):
    """A plan whose device speed is unknown has no seconds to hold the run to: TensorBoard and the summary get no
    ratio and no planned step; blocks compiled with train.compile=false (a memory policy's) leave two steps out."""
    import torch

    from flexengine.core.config import TrainConfig
    from flexengine.loop import progress
    from flexengine.loop.state import TrainState

    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.Progress(TrainConfig(max_steps=10), TrainState(), peak_tflops=None, compiled_blocks=True)
    clock.planned = progress.PlannedStep(0.05, "unknown device speed", None, {}, known=False)
    clock.start_loop(0)
    logged = {}

    class Metrics:
        def scalars(self, values, step):
            logged.update(values)

    m = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8, "useful_tokens": 8, "block_density": None}
    for seconds in (9.0, 7.0, 3.0, 2.5, 2.0):
        clock.start_step()
        now[0] += seconds
        clock.count({**m, "model_flops": 0.0, "hardware_flops": 0.0})
        clock.log_step(Metrics(), m, len(clock.step_times), eta_s=0.0, device=torch.device("cpu"))
    report = clock.step_time_report()
    assert report["excluded_first_steps"] == 2 and report["measured_s"] == 2.5
    assert report["ratio"] is None and report["planned_source"] == "unknown device speed"
    assert logged["step_time_ratio"] is None and logged["planned_step_s"] is None and logged["step_s"] == 2.0
    assert progress.Progress(TrainConfig(), TrainState(), peak_tflops=None).compiled_blocks is False  # as compile


def test_the_done_line_compares_no_step_with_an_unknown_speed():
    from flexengine.run import _step_vs_plan

    report = {"measured_s": 2.5, "planned_s": 0.05, "ratio": None, "excluded_first_steps": 2}
    line = _step_vs_plan({**report, "planned_source": "unknown device speed"})
    assert line == ", step 2.50 s measured (no planned time: unknown device speed)" and "planned (" not in line
    known = _step_vs_plan({**report, "planned_s": 2.0, "ratio": 1.25, "planned_source": "measured device speed"})
    assert "2.50 s measured vs 2.00 s planned (1.25x; planned from measured device speed" in known
    assert "far from its plan" not in known


@pytest.mark.parametrize("ratio", [0.09, 2.5])
def test_the_done_line_names_the_speed_cache_when_a_step_is_beyond_twice_its_plan(ratio, tmp_path, monkeypatch):
    from flexengine.core import device_speed
    from flexengine.run import _step_vs_plan

    monkeypatch.setenv(device_speed.CACHE_ENV, str(tmp_path / "speed.json"))
    report = {"measured_s": ratio, "planned_s": 1.0, "ratio": ratio, "excluded_first_steps": 1}
    line = _step_vs_plan({**report, "planned_source": "measured device speed"})
    assert f"cached in {tmp_path / 'speed.json'}" in line and "delete that file" in line
    assumed = _step_vs_plan({**report, "planned_source": "assumed MFU x datasheet peak"})
    assert "far from its plan" not in assumed  # an assumed speed has no cache to delete
