"""train.profile: the schedule skips warm-up steps, and a run leaves a trace plus a top-ops table."""

from __future__ import annotations

import json

from flexengine.cli.common import compose_job
from flexengine.loop.profiling import profile_schedule
from flexengine.run import run_training


def test_schedule_skips_first_steps_only_when_there_is_room():
    assert profile_schedule(10, 3) == {"wait": 1, "warmup": 1, "active": 3, "repeat": 1}
    assert profile_schedule(4, 3) == {"wait": 0, "warmup": 1, "active": 3, "repeat": 1}
    assert profile_schedule(2, 3) == {"wait": 0, "warmup": 0, "active": 2, "repeat": 1}
    # every schedule fits in the steps the run has, so the trace is always written
    for steps in range(1, 8):
        for active in range(1, 5):
            s = profile_schedule(steps, active)
            assert s["wait"] + s["warmup"] + s["active"] <= steps


def test_profiled_run_writes_trace_and_top_ops(tmp_path):
    job = compose_job(
        [
            "debug=fast",
            "train.max_steps=3",
            "train.profile=true",
            "train.profile_steps=1",
            "train.save_final=false",
            f"train.output_dir={tmp_path}",
        ]
    )
    summary = run_training(job, tmp_path)
    assert summary["steps"] == 3  # profiling does not change the loop
    traces = list((tmp_path / "tb" / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert sum(e.get("name") == "ProfilerStep#2" for e in events) == 1  # step 0 waited, step 1 warmed up
    table = (tmp_path / "profile_top_ops.txt").read_text()
    assert "Self CPU" in table and "aten::mm" in table
