"""Where each composed value came from: the command line, the last config file that set it, or the schema."""

from __future__ import annotations

import os
import subprocess
import sys

from flexengine.cli.common import compose_job_record
from flexengine.core.config_record import FROM_COMMAND_LINE, FROM_SCHEMA_DEFAULT, from_config_file


def test_command_line_files_in_composition_order_and_defaults():
    job, record = compose_job_record(
        ["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "train.max_steps=30"]
    )
    src = record.sources
    assert src["train.max_steps"] == src["model.init"] == FROM_COMMAND_LINE
    # optim.lr is set by conf/optim/adamw.yaml, conf/model/deepseek7b.yaml and the experiment: the last one owns it
    assert src["optim.lr"] == from_config_file("conf/experiment/deepseek7b_6k_a100.yaml")
    assert src["optim.weight_decay"] == from_config_file("conf/model/deepseek7b.yaml")  # the experiment leaves it
    assert src["optim.betas"] == from_config_file("conf/optim/adamw.yaml")
    assert src["model.arch"] == from_config_file("conf/model/deepseek7b.yaml")
    assert src["model.rope_scaling.factor"] == from_config_file("conf/experiment/deepseek7b_6k_a100.yaml")
    assert src["hardware.memory_gb"] == from_config_file("conf/hardware/a100_80g.yaml")
    assert src["train.seed"] == src["optim.schedule"] == FROM_SCHEMA_DEFAULT
    assert record.values["optim.lr"] == job.optim.lr == 2e-5


def test_a_key_typed_into_an_open_dict_and_an_overruled_file_key():
    _, record = compose_job_record(
        ["model=deepseek7b", "model.init=random", "model.arch.num_hidden_layers=2", "optim.warmup_steps=5"]
    )
    assert record.sources["model.arch"] == FROM_COMMAND_LINE  # part of it typed
    assert record.values["optim.warmup_ratio"] is None  # conf/model/deepseek7b.yaml's, excluded by the typed key
    assert record.sources["optim.warmup_ratio"].startswith(f"{FROM_COMMAND_LINE} (optim.warmup_steps typed")


def test_a_users_config_dir_is_named_by_its_path(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\noptim:\n  lr: 3.0e-4\n")
    _, record = compose_job_record([f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"])
    assert record.values["optim.lr"] == 3e-4
    assert record.sources["optim.lr"] == from_config_file(f"{tmp_path}/experiment/mine.yaml")


def test_the_resolved_yaml_runs_again_as_an_experiment(tmp_path):
    """resolved_config.yaml's first line makes it a global config: saved as experiment/rerun.yaml it composes
    to the same job (every key pinned, so no first-contact or planner step changes it again)."""
    job, record = compose_job_record(["debug=fast", "optim.lr=3e-4", "attn=causal", "train.micro_batch=1"])
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "rerun.yaml").write_text(record.to_yaml())
    again, _ = compose_job_record([f"hydra.searchpath=[file://{tmp_path}]", "experiment=rerun"])
    assert again == job


def test_a_hydra_app_names_a_config_dirs_file_and_the_files_its_defaults_chose(tmp_path):
    """Inside a Hydra app (flexengine-plan, as flexengine-train) the files come from Hydra's own defaults list: a
    --config-dir experiment's values are named by its path, the attn group its defaults list overrides by the
    shipped file, and a micro_batch typed alone keeps the experiment's rows per optimizer step."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /attn: causal\n"
        "optim:\n  lr: 3.0e-4\ntrain:\n  micro_batch: 1\n  grad_accum: 4\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "flexengine.plan", "--config-dir", str(tmp_path), "experiment=mine"]
        + ["train.micro_batch=2", "plan.format=resolved"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    group, sources = "", {}
    for line in proc.stdout.splitlines():  # resolved_config.yaml: groups, then `  key: value  # source`
        value, _, source = line.partition("  # ")
        if not line.startswith(("#", " ")):
            group = line.rstrip(":")
        elif source:
            sources[f"{group}.{value.split(':')[0].strip()}"] = source
    assert sources["optim.lr"] == from_config_file(f"{tmp_path}/experiment/mine.yaml")
    assert sources["attn.mode"] == from_config_file("conf/attn/causal.yaml")
    assert sources["optim.weight_decay"] == from_config_file("conf/optim/adamw.yaml")
    assert sources["train.micro_batch"] == FROM_COMMAND_LINE
    assert sources["train.grad_accum"].startswith("auto: keeps the config file's rows per optimizer step")
    assert "  grad_accum: 2  #" in proc.stdout  # the file's 1 x 4 rows at micro_batch 2
