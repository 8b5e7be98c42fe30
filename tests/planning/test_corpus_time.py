"""How long a corpus takes: steps from packed rows, hours from the planner's step time (the alternatives the plan
command weighs: tests/cli/test_plan_corpus.py)."""

from __future__ import annotations

import math

import pytest

from flexengine.cli.common import compose_job
from flexengine.core.hardware import assumed_hardware
from flexengine.planning.corpus_time import Corpus, corpus_row, format_corpus_hours
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
    fit = plan_job(job, hf_config, hardware)
    first = corpus_row("as configured", fit, corpus, world_size=1, cp=1, lora_r=0)
    assert first["label"] == "as configured" and first["step_s"] == fit.plan.chosen.time.step_s
    assert first["rows_per_step"] == fit.plan.chosen.micro_batch * fit.plan.chosen.grad_accum == 8
    assert first["steps"] == math.ceil(2 * 20_000 / 8) == 5_000
    assert first["hours"] == pytest.approx(5_000 * fit.plan.chosen.time.step_s / 3600)
    assert first["useful_tokens_per_s"] == pytest.approx(2 * 120e6 / (first["hours"] * 3600))
    text = format_corpus_hours([first], Corpus(20_000, 120_000_000, 2.0, "the seed corpus"), "a100_80g")
    assert "estimates" in text and "as configured" in text and "5,000" in text


def test_on_eight_cards_a_step_takes_eight_times_the_rows_and_cp_ranks_share_one():
    job, hf_config, hardware = _seed_job()
    fit = plan_job(job, hf_config, hardware)
    per_card = fit.plan.chosen.micro_batch * fit.plan.chosen.grad_accum
    corpus = Corpus(rows=20_000, useful_tokens=120_000_000)
    assert corpus_row("8", fit, corpus, world_size=8, cp=1, lora_r=0)["rows_per_step"] == 8 * per_card
    assert corpus_row("8, cp 4", fit, corpus, world_size=8, cp=4, lora_r=0)["rows_per_step"] == 2 * per_card
