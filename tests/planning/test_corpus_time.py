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
    assert first["label"] == "as configured" and first["step_s"] == fit.plan.chosen.time.step_s
    assert first["rows_per_step"] == fit.plan.chosen.micro_batch * fit.plan.chosen.grad_accum == 8
    assert first["steps"] == math.ceil(2 * 20_000 / 8) == 5_000
    assert first["hours"] == pytest.approx(5_000 * fit.plan.chosen.time.step_s / 3600)
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
    assert rows[1]["label"] == "LoRA r=16, 1 CPU"  # before: "1 GPU" on a CPU


def test_no_hours_without_a_known_speed_and_the_options_named():
    job = compose_job(["debug=fast", "hardware=auto"])  # this CPU, its speed unmeasured (tests turn it off)
    hardware = assumed_hardware(job.hardware)
    assert hardware.speed == () and hardware.peak_tflops is None
    rows = corpus_hours(job, build_hf_config(job.model), hardware, Corpus(100, 20_000))
    assert all(r["hours"] is None and r["step_s"] is None and r["useful_tokens_per_s"] is None for r in rows)
    assert {r["time_source"] for r in rows} == {"unknown device speed"}
    text = format_corpus_hours(rows, Corpus(100, 20_000, 1.0, "the demo"), "cpu")
    assert "0.0" not in text.split("\n")[2] and "n/a" in text
    assert "no hours" in text and "hardware=a100_80g" in text and "flexengine-doctor" in text


def test_a_measured_speed_gives_hours_and_says_so(monkeypatch, tmp_path):
    from flexengine.planning.resolve import resolve_target_hardware

    monkeypatch.delenv("FLEXENGINE_DEVICE_SPEED")
    monkeypatch.setenv("FLEXENGINE_SPEED_CACHE", str(tmp_path / "speed.json"))
    job = compose_job(["debug=fast", "hardware=auto"])
    hf_config = build_hf_config(job.model)
    hardware = resolve_target_hardware(job, hf_config)
    assert len(hardware.speed) == 1 and hardware.speed[0].dtype_bytes == 4  # CPU: the mode auto takes, fp32
    rows = corpus_hours(job, hf_config, hardware, Corpus(100, 20_000))
    assert rows[0]["hours"] > 0 and rows[0]["time_source"] == "measured device speed"
    text = format_corpus_hours(rows, Corpus(100, 20_000, 1.0, "the demo"), "cpu")
    assert "from measured device speed" in text and "no hours" not in text


def test_a_named_card_keeps_its_datasheet_wherever_it_is_planned():
    from flexengine.planning.resolve import resolve_target_hardware

    job, hf_config, _ = _seed_job()
    hardware = resolve_target_hardware(job, hf_config)
    assert hardware.speed == () and hardware.peak_tflops == 312.0
    rows = corpus_hours(job, hf_config, hardware, Corpus(rows=20_000, useful_tokens=120_000_000))
    assert {r["time_source"] for r in rows} == {"assumed MFU x datasheet peak"}
