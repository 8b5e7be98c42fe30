"""Fit before allocating: every run is planned from the HF config before any weight exists; an explicit choice
that does not fit is a clear error listing what would; auto resolves precision, policy and micro-batch once."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from flexengine.cli.doctor import compose_job
from flexengine.core.device_speed import DeviceSpeed
from flexengine.core.errors import UserError
from flexengine.core.hardware import assumed_hardware
from flexengine.planning.costs import MEASURED, UNKNOWN
from flexengine.planning.fit import (
    PrecisionTrial,
    check_fit,
    choose_precision,
    comparable_times,
    format_fit,
    plan_job,
    precision_verdicts,
    step_cell,
)
from flexengine.resolve import resolve
from flexengine.surgery.model import build_hf_config

SEVEN_B = ["model=llama2_7b", "model.init=random", "data.seq_len=8192", "hardware=a100_80g"]


def _fit(*overrides: str):
    job = compose_job(list(overrides))
    hf_config = build_hf_config(job.model)
    run = resolve(job, hf_config, assumed_hardware(job.hardware))
    check_fit(run.planned, run.fit, hf_config, run.attention)
    return run.job, run.fit


def test_defaults_are_auto():
    job = compose_job([])
    assert (job.memory.policy, job.precision.mode, job.hardware.name) == ("auto", "auto", "auto")


def test_explicit_policy_that_does_not_fit_lists_what_would():
    # a command the README once showed (memory=none, micro_batch 2) for Llama-2-7B at 8K on 80 GB: it does not fit
    with pytest.raises(UserError) as err:
        _fit(*SEVEN_B, "memory=none", "train.micro_batch=2")
    text = str(err.value)
    assert "memory=none does not fit a100_80g" in text and "What would fit" in text
    assert "memory=full" in text or "memory=selective" in text or "memory=offload" in text


def test_explicit_precision_that_does_not_fit_lists_what_would():
    with pytest.raises(UserError, match=r"precision=bf16_mixed does not fit[\s\S]*precision=bf16_"):
        _fit(*SEVEN_B, "precision=bf16_mixed")


def test_auto_resolves_everything_once():
    job, fit = _fit(*SEVEN_B)
    assert fit.plan.chosen.usage.fits and job.memory.policy != "auto" and job.precision.mode == fit.precision.name
    assert job.optim.name == fit.precision.optimizer
    assert job.train.micro_batch * job.train.grad_accum == 8  # llama2_7b's defaults: 1 x 8 rows per step
    assert fit.precision.updates_arrive(job.optim.lr)


def test_random_7b_on_this_cpu_stops_before_allocating(tmp_path, monkeypatch):
    """Defect 2's last case: a random-init 7B on a ~23 GB CPU machine used to allocate 28 GB before failing."""
    import flexengine.run as run

    def no_allocation(*args, **kwargs):
        raise AssertionError("weights were allocated before the plan said no")

    monkeypatch.setattr(run, "load_model", no_allocation)
    monkeypatch.setattr(run, "load_tokenizer", no_allocation)
    job = compose_job(
        [
            "model=llama2_7b",
            "model.init=random",
            "hardware.memory_gb=23",
            "hardware.host_memory_gb=23",
            f"train.output_dir={tmp_path}",
        ]
    )
    with pytest.raises(UserError, match="does not fit"):
        run.build_trainer(job, tmp_path)


def test_bf16_pure_is_only_taken_when_asked_and_warns_at_small_lr(caplog):
    _, fit = _fit(*SEVEN_B, "hardware=h200_141g")
    assert fit.precision.name != "bf16_pure"
    pure_row = next(r for r in fit.precision_table if r.precision == "bf16_pure")  # planned, to say why not
    assert pure_row.verdict.startswith("fails the long-horizon numerics check")
    with caplog.at_level(logging.WARNING, logger="flexengine.surgery.precision"):
        _, pure = _fit(*SEVEN_B, "precision=bf16_pure")
    assert pure.precision.name == "bf16_pure" and "round away" in caplog.text


@pytest.mark.parametrize("torchao_missing", [False, True], ids=["torchao", "no-torchao"])
def test_readme_experiment_auto_takes_the_fastest_mode_that_fits_and_trains_correctly(torchao_missing, monkeypatch):
    """On the README's deepseek7b_6k_a100 plan, precision=auto's step is within 5 % of the fastest
    fitting mode that passes the long-horizon numerics check and can be built here (it took bf16_cpu_master,
    planned 1.5x slower than bf16_sr), and the plan says for every other mode why it lost. Also without torchao
    (the lent GPU image): bf16_sr then cannot be built, so it is no rival."""
    if torchao_missing:
        import flexengine.planning.fit

        monkeypatch.setattr(
            flexengine.planning.fit, "optimizer_missing", lambda name: "torchao" if name == "adamw_bf16" else ""
        )
    job = compose_job(["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "data.seq_len=8192"])
    fit = plan_job(job, build_hf_config(job.model), assumed_hardware(job.hardware))
    rows = {r.precision: r for r in fit.precision_table}
    eligible = [r for r in rows.values() if r.fits and r.trains_correctly and not r.missing]
    assert (
        fit.plan.chosen.usage.fits and fit.precision.trains_correctly and len(eligible) >= (1 if torchao_missing else 2)
    )
    fastest = min(r.step_s for r in eligible)
    assert rows[fit.precision.name].step_s <= 1.05 * fastest
    text = format_fit(fit)
    for name, row in rows.items():
        assert f"{name:<16}" in text and row.verdict in text
        if name != fit.precision.name:
            assert row.verdict.startswith(
                ("slower: ", "does not fit: ", "fails the long-horizon", "ties with ", "needs ")
            )
    assert rows["bf16_pure"].verdict.startswith("fails the long-horizon numerics check")
    logged = precision_verdicts(fit)  # what a training run logs: one line per mode
    assert len(logged) == len(rows) and all(any(r.verdict in line for line in logged) for r in rows.values())


def test_auto_skips_a_mode_whose_optimizer_cannot_be_built_here(monkeypatch):
    """Without torchao, bf16_sr (torchao's AdamW) cannot be built: auto takes the next fastest correct mode and
    says why, instead of choosing a mode that stops at the optimizer."""
    import flexengine.planning.fit

    monkeypatch.setattr(
        flexengine.planning.fit, "optimizer_missing", lambda name: "torchao" if name == "adamw_bf16" else ""
    )
    job = compose_job(["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "data.seq_len=8192"])
    fit = plan_job(job, build_hf_config(job.model), assumed_hardware(job.hardware))
    rows = {r.precision: r for r in fit.precision_table}
    assert fit.plan.chosen.usage.fits and fit.precision.name == "bf16_cpu_master"
    assert rows["bf16_sr"].verdict == "needs torchao, not installed (pip install torchao)"


def _row(name: str, step_s: float, fits: bool = True, correct: bool = True, total: int = 1) -> PrecisionTrial:
    return PrecisionTrial(
        precision=name,
        fits=fits,
        total_bytes=total,
        host_bytes=0,
        policy="none",
        step_s=step_s,
        updates_exact=True,
        stochastic_rounding=False,
        trains_correctly=correct,
        missing="",
        why_not_fit="",
    )


@pytest.mark.parametrize(
    "rows,want",
    [
        ([_row("exact", 10.0), _row("fast", 8.0)], "fast"),  # faster wins
        ([_row("exact", 10.05), _row("fast", 10.0)], "exact"),  # within 1 %: the more exact
        ([_row("exact", 10.0), _row("pure", 5.0, correct=False)], "exact"),  # bf16_pure never
        ([_row("exact", 5.0, fits=False), _row("fast", 8.0)], "fast"),  # must fit
        ([_row("exact", 5.0, fits=False, total=3), _row("lean", 8.0, fits=False, total=2)], "lean"),
        ([_row("pure", 5.0, correct=False)], "pure"),  # asked for explicitly
    ],
)
def test_choose_precision(rows, want):
    assert rows[choose_precision(rows)].precision == want


def test_user_given_memory_fields_are_respected():
    job, fit = _fit(*SEVEN_B, "data.seq_len=12288", "memory.granularity=ops", "memory.offload=false")
    assert job.memory.policy == "selective" and job.memory.granularity == "ops" and not job.memory.offload
    assert {r.memory.granularity for r in fit.plan.candidates if r.k > 0} == {"ops"}
    # a constraint that cannot fit says so, and what would without it
    with pytest.raises(UserError, match=r"memory.granularity=ops memory.offload=False does not fit[\s\S]*memory=full"):
        _fit(*SEVEN_B, "data.seq_len=32768", "memory.granularity=ops", "memory.offload=false")


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_cpu_plan_picks_fp32(ranks):
    """On CPU auto takes the most exact mode that fits whatever the step estimates say (they have no CPU compute
    model): with 2 ranks the smaller bf16 all-reduce once made bf16_sr "faster", so a 2-rank run trained in another
    precision than one process of the same job."""
    job = compose_job(["debug=fast", f"hardware.world_size={ranks}"])
    fit = plan_job(job, build_hf_config(job.model), assumed_hardware(job.hardware))
    assert fit.plan.chosen.usage.fits and fit.precision.name == "fp32" and fit.plan.chosen.memory.policy == "none"
    assert all(r.verdict.startswith(("chosen", "less exact", "fails")) for r in fit.precision_table)
    faster = [_row("exact", 10.0), _row("fast", 1.0)]
    assert choose_precision(faster, timed=False) == 0 and choose_precision(faster) == 1


def test_offload_pins_at_most_the_host_budget_left_after_host_optimizer_state():
    """Offload's pinned-memory bound is the plan's per-rank host budget, less what the host optimizer
    keeps there, and the plan says the figure."""
    _, mixed = _fit(
        *SEVEN_B, "hardware=h200_141g", "precision=bf16_mixed", "memory=offload", "hardware.host_memory_gb=100"
    )
    assert mixed.plan.chosen.usage.host_budget_bytes == 100 * 2**30
    assert (
        mixed.plan.chosen.usage.offload_pinned_bound_bytes == 100 * 2**30
    )  # fp32 masters on the device: no host state
    assert (
        mixed.plan.chosen.usage.host_bytes <= mixed.plan.chosen.usage.offload_pinned_bound_bytes
    )  # fits: the activations pin
    assert "offload: at most 100.0 GiB of pinned host memory per rank" in format_fit(mixed)
    _, master = _fit(
        *SEVEN_B,
        "hardware=h200_141g",
        "precision=bf16_cpu_master",
        "memory=full",
        "memory.offload=true",
        "hardware.host_memory_gb=128",
    )
    state = master.plan.chosen.usage.host_bytes - _offloaded(
        master
    )  # the plan's host terms: state + offloaded activations
    assert state > 50 * 2**30  # fp32 masters and AdamW states of 6.7B parameters
    assert master.plan.chosen.usage.offload_pinned_bound_bytes == 128 * 2**30 - state


def _offloaded(fit) -> int:
    """The activation bytes the chosen policy offloads (the plan's other host term)."""
    chosen = next(
        r
        for r in fit.plan.candidates
        if r.label == fit.plan.chosen.label and r.micro_batch == fit.plan.chosen.micro_batch
    )
    return chosen.usage.offloaded_bytes


def test_trainer_offload_manager_gets_the_rank_share_of_host_memory(tmp_path, monkeypatch):
    """The bound travels from the resolved hardware (host memory / local ranks) through the plan into the
    OffloadManager the model's blocks use."""
    import flexengine.core.hardware as hardware
    import flexengine.run as run
    from flexengine.surgery.applied import applied

    monkeypatch.setattr(hardware, "available_host_memory_gb", lambda: 64.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    job = compose_job(["debug=fast", "memory=offload", "precision=fp32", f"train.output_dir={tmp_path}"])
    trainer, resolved = run.build_planned_trainer(job, tmp_path)
    manager = applied(trainer.model).offload
    assert resolved.hardware.host_memory_gb == 16.0
    assert manager.max_pinned_bytes == resolved.plan.chosen.usage.offload_pinned_bound_bytes == 16 * 2**30


def test_the_deepseek_experiment_compiles_because_the_planner_says_it_pays(tmp_path):
    """Eager blocks run their pointwise ops unfused (costs.eager_pointwise_s): over the experiment's steps that
    costs far more than compiling the blocks' one shared graph, so the shipped experiment compiles, and a run with
    train.compile=false is told what it loses."""
    from flexengine.cli.common import compose_job
    from flexengine.core.hardware import assumed_hardware
    from flexengine.planning.costs import COMPILE_S
    from flexengine.planning.fit import compile_hint, plan_job
    from flexengine.surgery.model import build_hf_config

    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    common = [
        "experiment=deepseek7b_6k_a100",
        "model.init=random",
        f"data.path={tmp_path / 'd.jsonl'}",
        "data.seq_len=8192",
    ]
    shipped = compose_job(common)
    assert shipped.train.compile
    eager = compose_job([*common, "train.compile=false"])
    fit = plan_job(eager, build_hf_config(eager.model), assumed_hardware(eager.hardware))
    assert fit.plan.chosen.time.eager_pointwise_s * eager.train.max_steps > 10 * COMPILE_S
    assert "train.compile=true would pay" in compile_hint(eager, fit) and not compile_hint(shipped, fit)


def test_a_measured_mode_is_never_ranked_against_an_unknown_one():
    """On CPU with fp32's speed measured (the dtype the run takes) and bf16's not: fp32's seconds print, the bf16
    modes' n/a, and precision=auto ranks none of them by time (the most exact that fits, saying why). With no
    speed known at all, every mode's step is n/a, not the fallback's seconds."""
    job = compose_job(["hardware.device=cpu", "data.seq_len=1024"])  # FLEXENGINE_DEVICE_SPEED=off: unknown
    hf_config, cpu = build_hf_config(job.model), assumed_hardware(job.hardware)
    measured = dataclasses.replace(cpu, speed=(DeviceSpeed(matmul_tflops=0.05, memory_gb_s=10.0, dtype_bytes=4),))
    fit = plan_job(job, hf_config, measured)
    rows = {r.precision: r for r in fit.precision_table}
    assert rows["fp32"].time_source == MEASURED and rows["bf16_mixed"].time_source == UNKNOWN
    assert not comparable_times(fit.precision_table) and fit.precision.name == "fp32"
    assert "are not comparable" in rows["bf16_mixed"].verdict
    table = format_fit(fit).splitlines()
    fp32, bf16 = (next(line for line in table if line.startswith(f"  {m} ")) for m in ("fp32", "bf16_mixed"))
    assert f"{rows['fp32'].step_s:.1f}" in fp32 and " n/a " in bf16

    unknown = plan_job(job, hf_config, cpu)
    assert {r.time_source for r in unknown.precision_table} == {UNKNOWN}
    text = format_fit(unknown)
    assert "this device's speed is unknown" in text and re.search(r"\s\d+\.\d+\s+yes", text) is None
    assert all(" n/a/step" in line for line in precision_verdicts(unknown))


def test_step_cells():
    assert step_cell(1.234, MEASURED, 7, 2) == "   1.23" and step_cell(1.234, UNKNOWN, 7, 2) == "    n/a"
    mixed = [dataclasses.replace(_row("exact", 248.6), time_source=MEASURED), _row("fast", 0.1)]
    assert not comparable_times(mixed) and mixed[choose_precision(mixed, timed=False)].precision == "exact"


def test_the_plan_line_gives_no_runner_up_seconds_from_an_unknown_speed():
    """On a device whose speed is unknown (tests turn the measurement off) the runners-up carry no fallback seconds."""
    from flexengine.planning.fit import format_fit_summary

    job = compose_job(["debug=fast", "hardware.device=cpu"])
    hf_config = build_hf_config(job.model)
    line = format_fit_summary(plan_job(job, hf_config, assumed_hardware(job.hardware)))
    assert "runners-up:" in line and "step time unknown" in line and "s/step" not in line
