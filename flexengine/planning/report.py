"""Glue for a training run: report the activation bytes per block (the meter on the first training forward, or the
planner's estimate)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from flexengine.core.config import MemoryConfig
from flexengine.planning.activations import estimate_activations, memory_specs
from flexengine.planning.shapes import ModelShape, PlanInputs, rank_workload
from flexengine.surgery.applied import applied
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.memory.meter import measure_activations

log = logging.getLogger(__name__)


def activation_summary(model: nn.Module, inputs: PlanInputs, memory: MemoryConfig) -> dict:
    """activation_bytes(_per_block) for summary.json: the planner's estimate, which a FirstForwardMeter replaces
    with the meter's measurement of the first training forward where the meter can see the blocks
    (meters_first_forward). No forward runs here: a synthetic one of a whole micro-batch before step 1 cost about a
    step's forward (17-45 s on CPU at 1-2 x 1,024 tokens; on a GPU a full 7B forward at 8K). inputs: the run's
    resolved PlanInputs (flexengine/resolve.py: ResolvedRun.inputs); memory: the policy applied."""
    shape = ModelShape.from_hf_config(model.config)
    est = estimate_activations(shape, rank_workload(inputs), memory_specs(memory, shape))
    return {
        "activation_bytes": est.total_bytes,
        "activation_bytes_per_block": est.per_block,
        "activation_other_bytes": est.other_bytes,
        "activation_offloaded_bytes": est.offloaded_bytes,
        "activation_bytes_source": "planner",
        "activation_measured_on": None,
        "memory_policy": dataclasses.asdict(memory),
    }


def meters_first_forward(model: nn.Module, world_size: int) -> bool:
    """Whether the meter can measure the run's own first forward: eager blocks with dense/sdpa attention (its
    dispatch mode neither mixes with compiled blocks nor has a rule for the flex_attention higher-order op) in one
    process (under FSDP/DDP the forward also gathers and frees parameters). Blocks compiled by a memory policy with
    train.compile=false count as compiled: metered, they would run eagerly and fail the compiled-blocks check."""
    record = applied(model)
    flex = record.attention is not None and record.attention.backend is AttnBackend.FLEX
    return record.compile_backend is None and not flex and world_size == 1


class FirstForwardMeter:
    """Measures what the first training forward through `module` leaves alive for its backward (the meter around
    that one real forward, no extra one), then writes it into `report` (activation_bytes_source "meter",
    activation_measured_on saying which forward) and calls `measured(report)`; later forwards run untouched."""

    def __init__(self, module: nn.Module, model: nn.Module, report: dict, measured: Callable[[dict], None]):
        self.module, self.model, self.report, self.measured = module, model, report, measured
        module.forward = self._forward  # an instance attribute: nn.Module.__call__ finds it before the class's

    def _forward(self, batch: dict, **kwargs: Any) -> torch.Tensor:
        forward = type(self.module).forward  # inside the module's own __call__ already: its hooks have run
        if kwargs.get("logits"):  # a sampling forward (no backward follows): the next one is measured
            return forward(self.module, batch, **kwargs)
        del self.module.forward  # once: the class's forward from now on
        meter, out = measure_activations(self.model, lambda: forward(self.module, batch, **kwargs))
        tokens = "x".join(map(str, batch["input_ids"].shape))
        self.report.update(
            meter.as_dict(),
            activation_bytes_source="meter",
            activation_measured_on=f"the first training forward (one micro-batch of {tokens} tokens)",
        )
        self.measured(self.report)
        return out
