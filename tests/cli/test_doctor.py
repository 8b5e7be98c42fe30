"""The doctor on CPU with planted problems: a padded baseline, checkpoint-all where nothing is needed, a card
too small for no checkpointing, and a recompile after warm-up; a healthy run gets no suggestions."""

from __future__ import annotations

import json

import pytest
import torch

from flexengine.cli.doctor import allocator_check, compose_job, diagnose, exit_status, format_report, run_doctor
from flexengine.core.config import SEQ_LEN_AUTO, JobConfig, TrainConfig, conf_dir
from flexengine.core.errors import UserError
from flexengine.loop.hooks import StepHooks
from flexengine.run import build_planned_trainer
from tests.helpers import DEBUG_FAST

STEPS = 1


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    out = tmp_path_factory.mktemp("healthy")
    return diagnose(compose_job([*DEBUG_FAST, "attn=packed_doc", "memory=none"]), out, steps=STEPS), out


def test_healthy_run_has_no_suggestions_and_writes_doctor_json(healthy):
    report, out = healthy
    assert report["suggestions"] == [], format_report(report)
    assert json.loads((out / "doctor.json").read_text())["checks"] == report["checks"]
    n = report["numbers"]
    assert n["attn_backend"] == "varlen" and n["attention"]["documents"] is True
    assert n["useful_token_fraction"] > 0.9
    assert n["recompiles_after_warmup"] == 0 and n["graphs_compiled_after_warmup"] == 0 and n["graph_breaks"] == 0
    assert 0 < n["block_density"] <= 1
    split = n["time_split"]
    assert split["forward"] > 0 and split["backward"] > 0 and split["optimizer"] > 0 and split["data"] > 0
    assert sum(split.values()) == pytest.approx(1.0, abs=1e-6)
    mem = n["memory"]
    assert mem["blocks_changed"] == [] and mem["fits"] and mem["planner_choice"]["policy"] == "none"
    assert mem["measured_peak_bytes"] is None  # CPU: the planner's figures only
    assert set(mem["allocator"].values()) == {None} and check(report, "allocator")["verdict"] == "info"


def test_padded_baseline_is_told_to_pack(tmp_path, capsys):
    report = run_doctor([*DEBUG_FAST, "attn=causal", "--steps", str(STEPS), "--out", str(tmp_path)])
    n = report["numbers"]
    assert n["attn_backend"] == "sdpa" and n["block_density"] is None
    assert n["useful_token_fraction"] < 0.9
    assert check(report, "useful tokens")["verdict"] in ("warn", "bad")
    assert any("attn=packed_doc" in s for s in report["suggestions"])
    printed = capsys.readouterr().out
    assert "attn=packed_doc" in printed and "doctor.json" in printed


def test_checkpointing_everything_when_nothing_is_needed(tmp_path):
    report = diagnose(compose_job([*DEBUG_FAST, "attn=packed_doc", "memory=full"]), tmp_path, steps=STEPS)
    mem = report["numbers"]["memory"]
    assert mem["blocks_changed"] == [0, 1, 2, 3] and mem["block_specs"] == ["block"] * 4
    assert mem["planner_choice"]["policy"] == "none" and mem["recompute_flops_fraction"] > 0
    assert check(report, "memory")["verdict"] == "warn"
    assert any("memory=auto" in s and "'none'" in s for s in report["suggestions"])


def test_too_small_a_card_asks_for_checkpointing(tmp_path):
    # weights + grads + AdamW moments of the 4M-parameter model take ~60 MiB: 0.07 GB leaves no room. The run is
    # planned before anything is allocated (flexengine.planning.fit), so it stops there, naming what would fit.
    with pytest.raises(UserError, match=r"precision=fp32 memory=none does not fit[\s\S]*What would fit"):
        diagnose(
            compose_job([*DEBUG_FAST, "memory=none", "precision=fp32", "hardware.memory_gb=0.07"]), tmp_path, steps=1
        )


class _SmallerBatchAtStep(StepHooks):
    """A planted recompile: from its 2nd step on, batches have one row instead of two (a new input shape)."""

    calls = 0

    def on_step_start(self, trainer, step: int) -> None:
        self.calls += 1  # the doctor drives train_step itself, so the trainer's step counter stays put
        if self.calls == 2:
            trainer.loader.micro_batch = 1


@pytest.mark.slow
def test_compiled_blocks_are_diagnosed_and_a_recompile_is_counted(tmp_path):
    """No dispatch mode around compiled code, and fullgraph recompiles are counted (they were always 0)."""
    torch._dynamo.reset()
    job = compose_job([*DEBUG_FAST, "attn=packed_doc", "train.compile=true", "train.compile_backend=aot_eager"])
    built = build_planned_trainer(job, tmp_path)
    trainer = built[0]
    healthy = diagnose(job, tmp_path, steps=1, built=built)["numbers"]
    assert healthy["graphs_compiled_warmup"] >= 1 and healthy["graphs_compiled_after_warmup"] == 0
    assert healthy["compile_backend"] == "aot_eager"
    trainer.add_hooks(_SmallerBatchAtStep())
    report = diagnose(job, tmp_path, steps=1, built=built)  # one warm-up step, then the planted one
    n = report["numbers"]
    assert n["recompiles_after_warmup"] >= 1 and "size mismatch" in " ".join(n["recompile_reasons"])
    assert check(report, "compile")["verdict"] == "warn"


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml")))
def test_every_experiment_composes(experiment):
    job = compose_job([f"experiment={experiment}", "model.path=/models/any", "data.path=/data/any.jsonl"])
    assert (job.data.fixed_seq_len or 0) > 0 or job.data.seq_len == SEQ_LEN_AUTO  # auto: chosen at the run
    assert job.train.max_steps > 0


def test_console_script_exits_0_on_a_healthy_run_and_prints_no_dict(tmp_path):
    import subprocess
    import sys

    # what the installed `flexengine-doctor` script runs: sys.exit(main())
    script = "import sys; from flexengine.cli.doctor import main; sys.argv[0] = 'flexengine-doctor'; sys.exit(main())"
    args = [*DEBUG_FAST, "attn=packed_doc", "memory=none", "--steps", "1", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flexengine doctor" in proc.stdout and "{'checks'" not in proc.stdout + proc.stderr


def test_exit_status_is_1_only_for_a_failed_check():
    def report(*verdicts):
        return {"checks": [{"verdict": v} for v in verdicts]}

    assert exit_status(report("ok", "info", "warn")) == 0
    assert exit_status(report("ok", "bad")) == 1


GB = 2**30
KNOBS = ("memory.policy", "memory.layers", "train.micro_batch", "hardware.memory_margin_gb")


def _cuda_numbers(*, reserved: float, retries: int = 0, ooms: int = 0, conf: str = "expandable_segments:True"):
    """A GPU run's numbers as diagnose records them: a 66 GiB allocated peak planned at 65 GiB with a 3.5 GiB
    margin (70 GiB budget): the reserved peak may reach 68.5 GiB."""
    allocated = 66 * GB
    return {
        "device": "cuda:0",
        "memory": {
            "policy": {"policy": "selective"},
            "blocks_changed": [0, 1, 2],
            "n_layers": 30,
            "budget_bytes": 70 * GB,
            "planned_total_bytes": 65 * GB,
            "margin_bytes": int(3.5 * GB),
            "cuda_alloc_conf": conf,
            "allocator": {
                "max_memory_allocated_bytes": allocated,
                "max_memory_reserved_bytes": int(reserved * GB),
                "allocator_overhead_bytes": int(reserved * GB) - allocated,
                "num_alloc_retries": retries,
                "num_ooms": ooms,
            },
        },
    }


JOB = JobConfig(train=TrainConfig(micro_batch=2))


def test_allocator_within_the_budget_is_ok():
    c = allocator_check(JOB, _cuda_numbers(reserved=68.5))
    assert c["verdict"] == "ok" and not c["suggestion"]
    assert "68.5 GiB reserved of 68.5 GiB (planned peak + margin" in c["value"] and "overhead 2.5" in c["value"]


def test_a_healthy_run_that_fills_its_budget_is_not_warned():
    """The README's plan allocates 74.26 of a 74.39 GiB budget: reserved above the budget but within the margin is
    what the margin is for."""
    c = allocator_check(JOB, _cuda_numbers(reserved=68.0))
    assert c["verdict"] == "ok"
    numbers = _cuda_numbers(reserved=71.0)
    numbers["memory"]["planned_total_bytes"] = int(69.9 * GB)  # within the budget; reserved 1 GiB past it
    assert allocator_check(JOB, numbers)["verdict"] == "ok"


def test_allocator_retries_warn_and_name_the_knobs():
    c = allocator_check(JOB, _cuda_numbers(reserved=68.5, retries=3, conf=None))
    assert c["verdict"] == "warn" and "retried after freeing the cache 3 time(s)" in c["detail"]
    assert all(k in c["suggestion"] for k in KNOBS) and "train.micro_batch (now 2" in c["suggestion"]
    # the user had turned expandable segments off (entry points default them on): say so
    assert "expandable_segments:True" in c["suggestion"]


def test_reserved_beyond_the_planned_peak_plus_margin_warns():
    c = allocator_check(JOB, _cuda_numbers(reserved=69.75))
    assert c["verdict"] == "warn" and "1.25 GiB beyond the planned peak plus the plan's margin" in c["detail"]
    assert all(k in c["suggestion"] for k in KNOBS)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in c["suggestion"]  # already on


def test_an_allocator_oom_is_a_failed_check():
    report = {"checks": [allocator_check(JOB, _cuda_numbers(reserved=69.9, ooms=1))]}
    c = report["checks"][0]
    assert c["verdict"] == "bad" and "ran out of memory 1 time(s)" in c["detail"]
    assert all(k in c["suggestion"] for k in KNOBS)
    assert exit_status(report) == 1


def test_the_doctor_reports_the_epoch_of_the_corpus_from_the_measured_steps(healthy):
    report, _ = healthy
    t = report["numbers"]["step_time"]
    assert t["measured_s"] > 0 and t["planned_s"] > 0 and t["steps_per_epoch"] >= 1
    assert t["epoch_s"] == pytest.approx(t["steps_per_epoch"] * t["measured_s"])
    assert "per epoch of this corpus" in check(report, "epoch time")["value"]


def test_doctor_json_records_the_job_that_trains_with_epochs_counted(tmp_path):
    """train.epochs becomes train.max_steps in the data stage, after the resolution: doctor.json's config is the
    job that trains (its step count), not the job as resolved."""
    job = compose_job([*DEBUG_FAST, "train.epochs=2"])
    trainer, run = build_planned_trainer(job, tmp_path)
    report = diagnose(job, tmp_path, steps=1, built=(trainer, run))
    recorded = json.loads((tmp_path / "doctor.json").read_text())["config"]["train"]
    assert recorded["max_steps"] == trainer.setup.train.max_steps != run.job.train.max_steps
    assert recorded["epochs"] == 2 and report["config"]["train"] == recorded
