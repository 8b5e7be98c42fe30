"""One resolution of a job (flexengine/resolve.py): hardware -> attention -> row length -> fit -> parallel,
written out once; its answer holds what later stages read, and the record takes its choices from it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from flexengine.cli.common import compose_job, compose_job_record
from flexengine.core.config_record import AUTO_HARDWARE, AUTO_PLANNER, AUTO_ROW_LENGTH
from flexengine.core.hardware import assumed_hardware
from flexengine.core.parallel_spec import ReduceEvery
from flexengine.data.packing import packer
from flexengine.planning.fit import plan_job
from flexengine.planning.row_length import Documents
from flexengine.planning.specs import context_rows, planned_attention
from flexengine.resolve import (
    record_resolution,
    resolve,
    resolve_planned,
    resolve_target_hardware,
)
from flexengine.surgery.model import build_hf_config

ROOT = Path(__file__).resolve().parents[1]
SEVEN_B = ["model=llama2_7b", "model.init=random", "data.seq_len=4096", "hardware=a100_80g"]


def test_the_answer_is_the_fit_of_the_job_on_its_hardware():
    """The ResolvedRun holds the fit plan_job gives the same job, and the job it derives carries the fit's answers
    (precision, memory policy, batch shape, the gradient reduction) for the loop."""
    job = compose_job([*SEVEN_B, "hardware.world_size=8", "train.grad_accum=4"])
    hf_config = build_hf_config(job.model)
    hardware = assumed_hardware(job.hardware)
    run = resolve(job, hf_config, hardware)
    fit = plan_job(job, hf_config, hardware, attention=planned_attention(job.attn, hf_config, hardware))
    assert run.plan.to_json() == fit.plan.to_json() and run.precision == fit.precision
    best = fit.plan.chosen
    assert (run.micro_batch, run.grad_accum, run.seq_len) == (best.micro_batch, best.grad_accum, 4096)
    assert run.memory_specs == best.specs
    assert run.job.precision.mode == fit.precision.name and run.job.memory == best.memory
    assert (run.job.train.micro_batch, run.job.train.grad_accum) == (best.micro_batch, best.grad_accum)
    assert run.parallel.reduce_every is best.time.reduce_every is not ReduceEvery.AUTO
    assert run.planned is job and run.job is not job and job.precision.mode == "auto"  # the given job is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.fit = fit  # type: ignore[misc]


def test_inputs_are_the_plans_inputs_at_the_fits_batch():
    """ResolvedRun.inputs prices what runs: its micro-batch is the fit's; batch_of keeps another job's batch."""
    job = compose_job([*SEVEN_B, "train.micro_batch=1", "train.grad_accum=8"])
    run = resolve_planned(job)
    assert run.inputs().micro_batch == run.micro_batch and run.inputs().grad_accum == run.grad_accum
    given = run.inputs(batch_of=job)
    assert (given.micro_batch, given.grad_accum) == (1, 8)
    assert given.precision == run.precision.name and given.seq_len == 4096


def test_an_auto_row_length_is_chosen_over_the_documents_or_is_the_context():
    job = compose_job(
        ["debug=fast", "hardware.device=cpu", "data.seq_len=auto", "model.arch.max_position_embeddings=512"]
    )
    hf_config = build_hf_config(job.model)
    hardware = resolve_target_hardware(job, hf_config)
    bare = resolve(job, hf_config, hardware)
    assert bare.rows is None and bare.seq_len == context_rows(hf_config) and bare.auto_seq_len
    lengths = np.full(64, 300)
    pack = packer(lengths, job.data.packing, job.data.long_docs)
    run = resolve(job, hf_config, hardware, documents=Documents(lengths, pack, "64 documents"))
    assert run.rows is not None and run.seq_len == run.rows.seq_len == run.job.data.seq_len
    assert run.rows.describe == "64 documents" and job.data.seq_len == "auto"


def test_the_record_takes_each_choice_with_its_source():
    """record_resolution: hardware.* from the hardware found, data.seq_len from the row length, memory.*,
    precision and the batch shape from the planner, in that order (the later source wins a key)."""
    job, record = compose_job_record(["debug=fast", "hardware.device=cpu", "data.seq_len=auto", "train.micro_batch=4"])
    run = resolve_planned(job)
    record_resolution(record, run)
    values, sources = record.values, record.sources
    assert values["data.seq_len"] == run.seq_len and sources["data.seq_len"] == AUTO_ROW_LENGTH
    assert values["hardware.host_memory_gb"] == run.hardware.host_memory_gb
    assert sources["hardware.host_memory_gb"].startswith(AUTO_HARDWARE)
    assert values["precision.mode"] == run.precision.name and sources["precision.mode"].startswith(AUTO_PLANNER)
    assert values["memory.policy"] == run.job.memory.policy and sources["memory.policy"].startswith(AUTO_PLANNER)
    assert values["train.micro_batch"] == run.micro_batch


# The sequence's steps, each called once in the package: in resolve.py, the composition root's (and the planner's
# own search in planning/fit.py, which plans variants of one job). A second copy elsewhere is the drift this module
# exists to stop.
SEQUENCE = {
    "plan_job": {"resolve.py", "planning/fit.py"},
    "resolved_job": {"resolve.py"},
    "resolve_target_hardware": {"resolve.py", "run.py"},
    "planned_attention": {"resolve.py", "planning/fit.py"},
    "choose_row_length": {"resolve.py"},
    "resolve_parallel": {"resolve.py", "planning/fit.py"},
    "plan_specs": {"resolve.py", "planning/fit.py"},
}
# bench/memtracker_cases.py is run on the planner of older revisions too (planner_vs_memtracker --baseline), which
# have no flexengine/resolve.py: it keeps the public calls those revisions share
BENCH_EXEMPT = {"bench/memtracker_cases.py"}


def _calls(path: Path) -> set[str]:
    """The names of the functions a file calls (f(...) or module.f(...)), definitions not counted."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_the_resolution_sequence_is_written_once():
    """Every caller (train, plan, doctor, corpus time, bench) goes through resolve(); no file outside the ones
    named in SEQUENCE calls a step of it."""
    files = [*ROOT.joinpath("flexengine").rglob("*.py"), *ROOT.joinpath("bench").glob("*.py")]
    found: dict[str, set[str]] = {name: set() for name in SEQUENCE}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in BENCH_EXEMPT:
            continue
        key = rel.removeprefix("flexengine/")
        for name in _calls(path) & SEQUENCE.keys():
            found[name].add(key)
    extra = {name: sorted(where - SEQUENCE[name]) for name, where in found.items() if where - SEQUENCE[name]}
    assert not extra, f"a step of the resolution sequence called outside resolve.py: {extra}"
    assert found["plan_job"] >= {"resolve.py"} and found["resolved_job"] == {"resolve.py"}
