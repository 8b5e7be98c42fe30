"""The run's speed figures: rates are of training time, and a launch that trains nothing reports no rate of its own."""

from __future__ import annotations

import json
import logging

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
    """A checkpoint of an older flexengine may carry 0 s of training: no rate, and the line says why."""
    from flexengine.loop import progress
    from flexengine.run import build_trainer, done_line

    out = tmp_path / "run"
    trainer = build_trainer(make_job(out, *DEBUG_FAST, "train.max_steps=1"), out)
    summary = progress.summary(trainer)  # nothing trained yet: train_s is 0
    assert summary["tokens_per_s"] is None and summary["useful_tokens_per_s"] is None and summary["mfu"] is None
    assert "no training time recorded" in done_line(summary, out / "summary.json")
    assert (
        progress.hparam_metrics(summary)["useful_tokens_per_s"]
        != progress.hparam_metrics(summary)["useful_tokens_per_s"]
    )  # NaN for TensorBoard's HPARAMS
