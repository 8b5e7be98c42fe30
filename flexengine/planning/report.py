"""Glue for a training run: report the activation bytes per block (measured, or the planner's estimate)."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from flexengine.core.config import JobConfig
from flexengine.planning.activations import estimate_activations, memory_specs
from flexengine.planning.shapes import ModelShape, rank_workload
from flexengine.planning.specs import plan_inputs, plan_specs
from flexengine.surgery.applied import attention_spec
from flexengine.surgery.attention.spec import AttnBackend, resolve_attention_spec
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory.meter import measure_activations
from flexengine.surgery.precision import PrecisionSpec

log = logging.getLogger(__name__)


def activation_summary(model: nn.Module, job: JobConfig, precision: PrecisionSpec, device: torch.device) -> dict:
    """activation_bytes(_per_block) for summary.json: measured by the meter on one synthetic forward when the
    blocks run eagerly with dense/sdpa attention (the dispatch mode neither mixes with compiled blocks nor has a
    rule for the flex_attention higher-order op), else the planner's estimate."""
    memory = job.memory
    spec = attention_spec(model)
    flex = spec is not None and spec.backend is AttnBackend.FLEX
    if not job.train.compile and not flex:
        B, S = job.train.micro_batch, job.data.seq_len
        ids = torch.zeros(B, S, dtype=torch.long, device=device)
        batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(S, device=device).expand(B, S)}
        with precision.compute_context(device):  # before sharding: one device's context
            report, out = measure_activations(model, lambda: forward_loss_sum(model, batch, job.loss.chunk_size))
        del out
        return {**report.as_dict(), "activation_bytes_source": "meter", "memory_policy": dataclasses.asdict(memory)}
    # the spec the surgery applied (run.py resolved it once); a model with HF's own attention: attn.* here
    attention = spec if spec is not None else resolve_attention_spec(job.attn, model.config, device=device)
    x = plan_inputs(plan_specs(job, model.config, attention), job.hardware, precision, on_cuda=device.type == "cuda")
    shape = ModelShape.from_hf_config(model.config)
    est = estimate_activations(shape, rank_workload(x), memory_specs(memory, shape))
    return {
        "activation_bytes": est.total_bytes,
        "activation_bytes_per_block": est.per_block,
        "activation_other_bytes": est.other_bytes,
        "activation_offloaded_bytes": est.offloaded_bytes,
        "activation_bytes_source": "planner",
        "memory_policy": dataclasses.asdict(memory),
    }
