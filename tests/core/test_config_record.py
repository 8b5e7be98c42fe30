"""The config record: flat keys as the schema declares them, each change attributed to its stage, YAML that reads
back to the same values."""

from __future__ import annotations

import dataclasses

import yaml

from flexengine.core.config import JobConfig, MixSource
from flexengine.core.config_record import (
    AUTO_PLANNER,
    FROM_COMMAND_LINE,
    FROM_SCHEMA_DEFAULT,
    ConfigRecord,
    flat_config,
    nest,
)


def test_flat_keys_follow_the_schema_and_nest_back_like_asdict():
    job = JobConfig()
    job.data.mix = [MixSource(path="a.jsonl", weight=2.0)]
    flat = flat_config(job)
    assert "model.lora.r" in flat and "optim.lr" in flat
    assert isinstance(flat["model.arch"], dict)  # a dict-typed field is one value, as the schema declares it
    assert flat["data.mix"] == [dataclasses.asdict(job.data.mix[0])]
    as_dict = dataclasses.asdict(job)
    del as_dict["hardware"]["speed"]  # a measurement, not a setting: the schema keeps it out (omegaconf_ignore)
    assert nest(flat) == as_dict


def test_each_change_is_attributed_to_the_stage_that_made_it():
    job = JobConfig()
    record = ConfigRecord(
        job, {k: FROM_COMMAND_LINE if k == "optim.lr" else FROM_SCHEMA_DEFAULT for k in flat_config(job)}
    )
    planned = dataclasses.replace(job, train=dataclasses.replace(job.train, micro_batch=1, grad_accum=4))
    assert record.update(planned, AUTO_PLANNER) == ["train.micro_batch", "train.grad_accum"]
    assert record.values["train.micro_batch"] == 1
    assert record.sources["train.micro_batch"] == f"{AUTO_PLANNER}; replaces 2, {FROM_SCHEMA_DEFAULT}"
    assert record.sources["optim.lr"] == FROM_COMMAND_LINE  # untouched by the stage
    assert record.kinds()["train.grad_accum"] == "auto" and record.kinds()["optim.lr"] == "yours"
    record.set("attn.backend", "varlen", "auto: attention backend")
    assert record.as_config()["attn"]["backend"] == "varlen"
    record.drop("hardware")
    assert not any(k.startswith("hardware.") for k in record.values)
    assert record.update(job, AUTO_PLANNER) == ["attn.backend", "train.micro_batch", "train.grad_accum"]


def test_the_yaml_reads_back_to_the_values_and_names_every_source(tmp_path):
    job = JobConfig()
    job.optim.betas = [0.9, 0.99]
    job.train.sample_prompts = ["def f(x):", "a: b # not a comment"]
    record = ConfigRecord(job, FROM_SCHEMA_DEFAULT)
    record.set("optim.lr", 2e-5, "first-contact: from conf/model/llama2_7b.yaml")
    path = record.write(tmp_path / "resolved_config.yaml")
    text = path.read_text()
    assert text.startswith("# @package _global_\n")
    assert yaml.safe_load(text) == record.as_config()
    lines = [line for line in text.splitlines() if not line.startswith("#") and not line.rstrip().endswith(":")]
    assert len(lines) == len(record.values) and all("  # " in line for line in lines)  # a source on every value
    assert "  lr: 2.0e-05  # first-contact: from conf/model/llama2_7b.yaml" in text


def test_a_job_built_in_python_with_paths_and_enums_writes_plain_yaml(tmp_path):
    """A JobConfig built in Python may hold a Path (model.path, train.output_dir): the record writes its string."""
    from enum import Enum
    from pathlib import Path

    class Kind(Enum):
        TEXT = "text"

    job = JobConfig()
    job.train.output_dir = Path("/runs/a")  # type: ignore[assignment]
    job.model.arch = {"kind": Kind.TEXT, 3: Path("/x")}
    record = ConfigRecord(job, FROM_SCHEMA_DEFAULT)
    text = record.write(tmp_path / "resolved_config.yaml").read_text()
    assert yaml.safe_load(text)["train"]["output_dir"] == "/runs/a"
    assert record.as_config()["model"]["arch"] == {"kind": "text", "3": "/x"}
