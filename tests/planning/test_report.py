"""The activation bytes a run reports (flexengine/planning/report.py): measured by the meter when the blocks run
eagerly with a dense mask, else the planner's estimate, and the two agree on the same run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flexengine.cli.common import compose_job
from flexengine.core.hardware import resolve_hardware
from flexengine.planning.report import activation_summary
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
from flexengine.surgery.precision import precision_spec
from tests.helpers import make_llama

CPU = torch.device("cpu")


@pytest.mark.parametrize("memory", ["memory=none", "memory=full"])
def test_meter_when_eager_and_dense_else_the_planner_and_they_agree(memory):
    job = compose_job(
        ["attn=packed_doc", "attn.backend=dense", memory, "train.compile=false", "data.seq_len=256", "precision=fp32"]
    )
    job = dataclasses.replace(job, hardware=resolve_hardware(job.hardware, CPU))
    model = patch_attention(make_llama(), mode="packed_doc", backend="dense")
    apply_memory_policy(model, block_memory_specs(job.memory, model.config.num_hidden_layers))
    model.train()
    measured = activation_summary(model, job, precision_spec("fp32"), CPU)
    compiled = dataclasses.replace(job, train=dataclasses.replace(job.train, compile=True))
    planned = activation_summary(model, compiled, precision_spec("fp32"), CPU)  # a meter cannot see compiled blocks
    assert (measured["activation_bytes_source"], planned["activation_bytes_source"]) == ("meter", "planner")
    assert planned["activation_bytes"] == pytest.approx(measured["activation_bytes"], rel=0.05)
    layers = model.config.num_hidden_layers
    assert len(measured["activation_bytes_per_block"]) == len(planned["activation_bytes_per_block"]) == layers
    assert measured["memory_policy"] == planned["memory_policy"] == dataclasses.asdict(job.memory)
