"""How long a corpus takes: steps from packed rows, hours from the planner's step time, and the alternatives."""

from __future__ import annotations

import math

import pytest

from flexengine.cli.common import compose_job
from flexengine.core.hardware import assumed_hardware
from flexengine.planning.corpus_time import NODE, Corpus, corpus_hours, format_corpus_hours
from flexengine.planning.fit import plan_job
from flexengine.surgery.model import build_hf_config


def _seed_job(*overrides: str):
    job = compose_job(
        ["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "data.seq_len=8192", *overrides]
    )
    return job, build_hf_config(job.model), assumed_hardware(job.hardware)


def test_hours_are_the_planned_steps_of_the_packed_rows():
    job, hf_config, hardware = _seed_job()
    corpus = Corpus(rows=20_000, useful_tokens=120_000_000, epochs=2.0)
    rows = corpus_hours(job, hf_config, hardware, corpus)
    first = rows[0]
    fit = plan_job(job, hf_config, hardware)
    assert first["label"] == "as configured" and first["step_s"] == fit.plan.step_s
    assert first["rows_per_step"] == fit.micro_batch * fit.grad_accum == 8
    assert first["steps"] == math.ceil(2 * 20_000 / 8) == 5_000
    assert first["hours"] == pytest.approx(5_000 * fit.plan.step_s / 3600)
    assert first["useful_tokens_per_s"] == pytest.approx(2 * 120e6 / (first["hours"] * 3600))


def test_the_alternatives_weigh_lora_and_a_node_at_the_same_rows_per_step():
    job, hf_config, hardware = _seed_job()
    rows = corpus_hours(job, hf_config, hardware, Corpus(rows=20_000, useful_tokens=120_000_000))
    by = {(r["lora_r"], r["world_size"]): r for r in rows}
    assert set(by) == {(0, 1), (0, NODE), (16, 1), (16, NODE)}
    assert all(r["rows_per_step"] == 8 and r["steps"] == 2_500 for r in rows)  # the same optimization, faster
    assert by[0, NODE]["hours"] < by[0, 1]["hours"] / 4  # eight cards
    assert by[16, 1]["hours"] < by[0, 1]["hours"]  # no weight gradients for the frozen base
    text = format_corpus_hours(rows, Corpus(20_000, 120_000_000, 1.0, "the seed corpus"), "a100_80g")
    assert "estimates" in text and "LoRA r=16, 8 GPUs" in text and text.count("\n") == len(rows) + 1


def test_on_cpu_only_the_job_and_its_lora_twin():
    job = compose_job(["debug=fast", "hardware=cpu"])
    rows = corpus_hours(job, build_hf_config(job.model), assumed_hardware(job.hardware), Corpus(100, 20_000))
    assert [(r["lora_r"], r["world_size"]) for r in rows] == [(0, 1), (16, 1)]
