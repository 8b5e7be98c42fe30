"""The activation bytes a run reports (flexengine/planning/report.py): the planner's estimate, replaced by the meter's
measurement of the first training forward when the blocks run eagerly with a dense mask; the two agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flexengine.cli.common import compose_job
from flexengine.core.hardware import resolve_hardware
from flexengine.planning.report import FirstForwardMeter, activation_summary, meters_first_forward
from flexengine.resolve import resolve
from flexengine.surgery.applied import applied, attention_spec
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
from flexengine.surgery.parallel import LossForward
from tests.helpers import make_llama

CPU = torch.device("cpu")


@pytest.mark.parametrize("memory", ["memory=none", "memory=full"])
def test_the_first_training_forward_is_metered_and_agrees_with_the_planner(memory):
    """No forward of its own at start-up (a synthetic micro-batch cost about a step's forward): the planner's
    estimate first, then the meter around the first real forward replaces it, once, saying which forward."""
    job = compose_job(
        ["attn=packed_doc", "attn.backend=dense", memory, "train.compile=false", "data.seq_len=256", "precision=fp32"]
    )
    model = patch_attention(make_llama(), mode="packed_doc", backend="dense")
    run = resolve(job, model.config, resolve_hardware(job.hardware, CPU), attention=attention_spec(model))
    apply_memory_policy(model, block_memory_specs(job.memory, model.config.num_hidden_layers))
    model.train()
    planned = activation_summary(model, run.inputs(), run.job.memory)
    assert planned["activation_bytes_source"] == "planner" and planned["activation_measured_on"] is None
    assert meters_first_forward(model, world_size=1) and not meters_first_forward(model, 2)
    applied(model).compile_backend = "inductor"  # compiled blocks (by train.compile or by the memory policy)
    assert not meters_first_forward(model, 1)
    applied(model).compile_backend = None
    report, seen = dict(planned), []
    module = LossForward(model, job.loss.chunk_size)
    FirstForwardMeter(module, model, report, seen.append)
    B, S = job.train.micro_batch, job.data.seq_len
    ids = torch.randint(0, model.config.vocab_size, (B, S))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(S).expand(B, S)}
    module(batch, logits=True)  # a sampling forward is not what backward keeps: not measured
    assert seen == []
    module(batch).backward()
    module(batch)  # later forwards run untouched
    assert seen == [report] and "forward" not in vars(module)
    assert report["activation_bytes_source"] == "meter"
    assert report["activation_measured_on"] == f"the first training forward (one micro-batch of {B}x{S} tokens)"
    assert planned["activation_bytes"] == pytest.approx(report["activation_bytes"], rel=0.05)
    layers = model.config.num_hidden_layers
    assert len(report["activation_bytes_per_block"]) == len(planned["activation_bytes_per_block"]) == layers
    assert report["memory_policy"] == planned["memory_policy"] == dataclasses.asdict(job.memory)


def test_a_run_reports_its_first_forwards_activations_and_how_they_were_measured(tmp_path):
    """Through the real loop: summary.json keeps the meter's figure of step 1's first micro-batch and says so."""
    import json

    from flexengine.run import run_training
    from tests.helpers import make_job

    summary = run_training(make_job(tmp_path, "train.max_steps=1", "train.compile=false"), tmp_path)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["activation_bytes_source"] == summary["activation_bytes_source"] == "meter"
    assert written["activation_measured_on"].startswith("the first training forward (one micro-batch of 2x256")
    assert written["activation_bytes"] == sum(written["activation_bytes_per_block"]) + written["activation_other_bytes"]
