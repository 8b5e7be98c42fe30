"""Glue for a training run: resolve memory=auto with the planner, and report the activation bytes per block."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from flexengine.applied import attention_spec
from flexengine.attention.spec import AttnBackend
from flexengine.config import JobConfig, MemoryConfig
from flexengine.loss import forward_loss_sum
from flexengine.memory.meter import measure_activations
from flexengine.memory.planner import (
    ModelShape,
    Workload,
    estimate_activations,
    plan_inputs,
    plan_memory,
    resolve_tiled_mlp,
)

log = logging.getLogger(__name__)


def resolve_memory(job: JobConfig, hf_config) -> MemoryConfig:
    """memory.policy=auto -> the planner's cheapest policy that fits (logged); memory.tiled_mlp=auto -> tiled
    only if the untiled policy does not fit; anything else unchanged."""
    if job.memory.policy != "auto":
        if job.memory.tiled_mlp != "auto":
            return job.memory
        memory = resolve_tiled_mlp(hf_config, plan_inputs(job), job.memory)
        log.info("memory.tiled_mlp=auto: %s", f"{memory.tiled_mlp} tokens per tile" if memory.tiled_mlp else
                 "off (the step fits untiled)")
        return memory
    plan = plan_memory(hf_config, plan_inputs(job), job.memory.tiled_mlp)
    memory = MemoryConfig(**plan["memory"])
    level = logging.INFO if plan["fits"] else logging.WARNING
    log.log(level, "memory=auto: planner chose %r (%s; %.1f of %.1f GiB, recompute %.1f%% of step FLOPs)%s",
            plan["policy"], dataclasses.asdict(memory), plan["total_bytes"] / 2**30, plan["budget_bytes"] / 2**30,
            100 * plan["recompute_flops_fraction"], "" if plan["fits"] else
            "; NOTHING FITS: " + "; ".join(plan["suggestions"]))
    return memory


def activation_summary(model: nn.Module, job: JobConfig, memory: MemoryConfig, device: torch.device) -> dict:
    """activation_bytes(_per_block) for summary.json: measured by the meter on one synthetic forward when the
    blocks run eagerly with dense/sdpa attention (the dispatch mode neither mixes with compiled blocks nor has a
    rule for the flex_attention higher-order op), else the planner's estimate."""
    spec = attention_spec(model)
    flex = spec is not None and spec.backend is AttnBackend.FLEX
    if not job.train.compile and not flex:
        B, S = job.train.micro_batch, job.data.seq_len
        ids = torch.zeros(B, S, dtype=torch.long, device=device)
        batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(S, device=device).expand(B, S)}
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
            "cpu", enabled=False)
        with autocast:
            report, out = measure_activations(model, lambda: forward_loss_sum(model, batch, job.loss.chunk_size))
        del out
        return {**report.as_dict(), "activation_bytes_source": "meter", "memory_policy": dataclasses.asdict(memory)}
    x = plan_inputs(job, on_cuda=device.type == "cuda")
    est = estimate_activations(ModelShape.from_hf_config(model.config),
                               Workload(x.micro_batch, x.seq_len, x.dtype_bytes, x.backend, x.chunk_size), memory)
    return {"activation_bytes": est.total_bytes, "activation_bytes_per_block": est.per_block,
            "activation_other_bytes": est.other_bytes, "activation_offloaded_bytes": est.offloaded_bytes,
            "activation_bytes_source": "planner", "memory_policy": dataclasses.asdict(memory)}
