"""loss.fused through the real loop: the same losses as the chunked loss, and no lm_head re-run in the run's
executed FLOPs."""

from __future__ import annotations

import pytest

from flexengine.cli.common import compose_job_record
from flexengine.run import run_training

# debug=fast on the CPU, chunks of 64 tokens: every row's 255 predicting positions take four chunks
OVERRIDES = ("debug=fast", "hardware.device=cpu", "train.max_steps=2", "loss.chunk_size=64")


def test_a_fused_run_trains_as_the_chunked_one_without_the_rerun(tmp_path):
    summaries = {}
    for fused in (False, True):
        job, record = compose_job_record([*OVERRIDES, f"loss.fused={str(fused).lower()}"])
        summaries[fused] = run_training(job, tmp_path / f"fused_{fused}", record)
    chunked, fused = summaries[False], summaries[True]
    assert fused["config"]["loss"] == {"chunk_size": 64, "fused": True}
    assert fused["steps"] == chunked["steps"] == 2 and len(fused["losses"]) == 2
    assert fused["losses"] == pytest.approx(chunked["losses"], rel=1e-5, abs=0)
    work = {name: s["work_per_useful_token"] for name, s in summaries.items()}
    assert work[True]["loss_recompute_flops"] == 0 < work[False]["loss_recompute_flops"]
    # the report's re-run is per useful token (about the predicting positions); the executed count's is exact
    assert work[False]["executed_flops"] - work[True]["executed_flops"] == pytest.approx(
        work[False]["loss_recompute_flops"], rel=1e-2
    )
