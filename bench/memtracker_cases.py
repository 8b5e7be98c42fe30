"""The cases the MemTracker bench runs and the planner's terms for each (bench/memtracker_step.py tracks the step):
imports nothing but the planner's and the config's public calls, so the planner of an older revision can be run on
the same cases (bench/planner_vs_memtracker.py --baseline)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from flexengine.cli.common import compose_job
from flexengine.core.config import MemoryConfig
from flexengine.planning.fit import plan_specs  # fit.py imported it from specs.py in older revisions: both have it
from flexengine.planning.planner import evaluate, spread_layers
from flexengine.planning.shapes import ModelShape
from flexengine.planning.specs import plan_inputs
from flexengine.surgery.attention.spec import resolve_attention_spec
from flexengine.surgery.model import build_hf_config
from flexengine.surgery.precision import precision_spec

EXPERIMENT = "experiment=deepseek7b_6k_a100"  # the README's headline job: deepseek-7B width, 8K rows, A100-80G
GiB = 2**30


# -- the tracker: MemTracker's peak, and where each byte alive at it came from -----------------------------------
def sac_blocks(layers: int) -> int:
    """k of op-level SAC: three blocks in four, as the README's plan (23 of 30)."""
    return math.ceil(3 * layers / 4)


def policy_config(policy: str, layers: int) -> MemoryConfig:
    """memory.* of a bench policy: none | full | ops (SAC on k spread blocks) | offload | ops+offload |
    full+offload+tiled (mistral7b_32k_h100's plan)."""
    ops = dict(policy="selective", granularity="ops", layers=spread_layers(sac_blocks(layers), layers))
    return {
        "none": MemoryConfig(),
        "full": MemoryConfig(policy="full"),
        "ops": MemoryConfig(**ops),
        "offload": MemoryConfig(policy="offload"),
        "ops+offload": MemoryConfig(**ops, offload=True),
        "full+offload+tiled": MemoryConfig(policy="full", offload=True, tiled_mlp=4096),  # ALST's hidden-size tiles
    }[policy]


@dataclass(frozen=True)
class Case:
    """One step: the README's job at this depth, policy, precision mode and micro-batch."""

    layers: int
    policy: str = "none"
    precision: str = "bf16_mixed"
    micro_batch: int = 1
    seq_len: int = 8192
    arch: tuple = ()  # (key, value) overrides of model.arch (a small model for the fake-vs-real test)
    experiment: str = EXPERIMENT
    chunk_size: Optional[int] = None  # loss.chunk_size (None: the experiment's 1024)

    @property
    def memory(self) -> MemoryConfig:
        """The memory.* this case applies."""
        return policy_config(self.policy, self.layers)

    @property
    def label(self) -> str:
        """e.g. 'L30 ops k=23 bf16_sr mb1' (the experiment's name first when it is not the README's)."""
        k = f" k={sac_blocks(self.layers)}" if self.policy.startswith("ops") else ""
        name = "" if self.experiment == EXPERIMENT else self.experiment.split("=")[-1] + " "
        return f"{name}L{self.layers} {self.policy}{k} {self.precision} mb{self.micro_batch}"

    def job(self):
        """The composed JobConfig (as `flexengine.plan` composes it), random weights at this depth."""
        return compose_job(
            [
                self.experiment,
                "model.init=random",
                "data.source=demo",  # as `flexengine.plan` does without data.path: only data.seq_len matters
                f"model.arch.num_hidden_layers={self.layers}",
                f"train.micro_batch={self.micro_batch}",
                f"data.seq_len={self.seq_len}",
                f"precision={self.precision}",
                *(f"model.arch.{key}={value}" for key, value in self.arch),
                *([f"loss.chunk_size={self.chunk_size}"] if self.chunk_size is not None else []),
            ]
        )


# -- the planner's terms for the same step -------------------------------------------------------------------------
# The planner's device terms a tensor tracker can see (not the CUDA reserve or a margin: no tensor holds them)
PLANNER_TERMS = {
    "weights": ("weights_bytes",),
    "grads": ("grads_bytes",),
    "optimizer": ("optimizer_bytes", "embedding_optimizer_bytes"),
    "compute_copy": ("compute_copy_bytes",),
    "activations": ("activation_bytes",),
    "offload_in_flight": ("offload_in_flight_bytes",),
    "workspace": ("backward_workspace_bytes",),
}


def planner_step(case: Case) -> dict:
    """The planner's terms for `case` as `flexengine.plan` computes them (plan_inputs of the composed job on
    its CUDA hardware; `evaluate` of the case's memory policy), plus its host bytes."""
    job = case.job()
    spec = precision_spec(job.precision.mode)
    hf_config = build_hf_config(job.model)
    m = ModelShape.from_hf_config(hf_config)
    device = torch.device("cuda" if job.hardware.on_cuda else "cpu")  # as the plan resolves attn.* for its card
    attention = resolve_attention_spec(job.attn, hf_config, device=device)
    specs = plan_specs(job, hf_config, attention)
    row = evaluate(m, plan_inputs(specs, job.hardware, spec, on_cuda=True), case.memory)
    by_name = row.usage.terms.to_json()
    terms = {part: sum(by_name.get(key, 0) for key in keys) for part, keys in PLANNER_TERMS.items()}
    return {"terms": terms, "total": sum(terms.values()), "host_bytes": row.usage.host_bytes, "row": row}
