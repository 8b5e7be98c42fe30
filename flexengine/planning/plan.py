"""What the planner answers, as frozen values: one step's device-byte terms, one evaluated policy (`Candidate`) and
the plan (`Plan`: the chosen candidate, the assumptions, every candidate weighed, what to change if none fits).

Callers read fields; `to_json` writes the plan command's JSON (`flexengine-plan plan.format=json`), whose keys and
their order are a user contract (tests/planning/test_plan.py pins them).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from flexengine.core.config import MemoryConfig
from flexengine.core.parallel_spec import ReduceEvery
from flexengine.planning.budget import DeviceBudget
from flexengine.planning.shapes import AttendedPairs
from flexengine.surgery.memory.spec import MemorySpec

JsonDict = dict[str, Any]  # what json.dumps writes: values of many kinds, by design


@dataclass(frozen=True, kw_only=True)
class DeviceTerms:
    """One step's device bytes by term on this rank; their sum is the planned peak. None: the term does not arise
    here (and is left out of the JSON). Fields in the JSON's order."""

    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int  # AdamW's exp_avg + exp_avg_sq (without the embedding's under adamw_8bit)
    embedding_optimizer_bytes: Optional[int] = None  # adamw_8bit: the input embedding's states, kept in fp32
    compute_copy_bytes: Optional[int] = None  # autocast's cached compute-dtype weight copies
    activation_bytes: int  # saved for backward, all blocks plus the loss side
    backward_workspace_bytes: int  # the loss or one block's recompute/gradients at backward's peak
    offload_in_flight_bytes: int  # activation offload's blocks between device and host
    fsdp_gathered_weights_bytes: Optional[int] = None  # FSDP: two blocks and the root all-gathered
    fsdp_unsharded_grads_bytes: Optional[int] = None  # FSDP: gradients before their reduce-scatter

    def items(self) -> list[tuple[str, int]]:
        """(name, bytes) of every term that arises, in the JSON's order."""
        pairs = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return [(name, value) for name, value in pairs if value is not None]

    @property
    def total_bytes(self) -> int:
        """The planned peak: every term summed."""
        return sum(value for _, value in self.items())

    def to_json(self) -> dict[str, int]:
        """The terms as the plan's JSON writes them."""
        return dict(self.items())


@dataclass(frozen=True)
class MemoryUse:
    """One policy's bytes: device terms, host bytes, the budgets they must fit, and whether they do."""

    terms: DeviceTerms
    activation_bytes_per_block: tuple[int, ...]  # saved for backward by each decoder block
    offloaded_bytes: int  # activations kept in host memory per micro-batch
    workspace_bytes: int  # backward's workspace plus offload's buffers in flight
    budget: DeviceBudget  # the card less the CUDA context and the margin
    host_bytes: int  # host optimizer state plus offloaded activations
    host_budget_bytes: int  # this rank's host memory; 0: unknown, unchecked (library use)
    offload_pinned_bound_bytes: Optional[int]  # pinned host bytes offload may hold; None without a host budget
    fits: bool

    def to_json(self) -> JsonDict:
        """The bytes part of a candidate's JSON row."""
        return {
            "activation_bytes": self.terms.activation_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "workspace_bytes": self.workspace_bytes,
            "total_bytes": self.terms.total_bytes,
            **budget_json(self.budget),
            "host_bytes": self.host_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "offload_pinned_bound_bytes": self.offload_pinned_bound_bytes,
            "fits": self.fits,
            "terms": self.terms.to_json(),
        }


def budget_json(budget: DeviceBudget) -> dict[str, int]:
    """A device budget as the plan's JSON names it."""
    return {
        "budget_bytes": budget.usable_bytes,
        "card_bytes": budget.card_bytes,
        "cuda_context_bytes": budget.context_bytes,
        "margin_bytes": budget.margin_bytes,
    }


@dataclass(frozen=True)
class StepTime:
    """One policy's estimated optimizer step, in seconds and the bytes that cross links. Fields in the JSON's
    order."""

    recompute_flops_fraction: float  # recompute FLOPs / the step's FLOPs
    recompute_pointwise_s: float  # memory-bound pointwise ops re-run per micro-batch
    offload_bytes_per_step: int  # activation offload, both ways, all micro-batches
    offload_exposed_s: float  # offload traffic per micro-batch that compute does not hide
    optimizer_s: float  # the host optimizer's exposed seconds
    host_optimizer_pcie_bytes_per_step: int
    reduce_every: ReduceEvery  # FSDP's gradient reduce-scatter: once per window, or every micro-batch
    eager_pointwise_s: float  # what uncompiled blocks' unfused pointwise ops add
    reduce_scatter_bytes_per_step: int
    reduce_scatter_s: float
    reduce_exposed_s: float  # reduce-scatter seconds backward does not hide
    step_s: float
    cost: float  # (recompute + exposed offload seconds) / compute seconds: the overhead the policy adds
    # the step's seconds by term (all micro-batches): what a measured step is compared with, term by term
    matmul_s: float = 0.0  # the matmuls, forward and backward
    attention_s: float = 0.0  # the attention core (its attended pairs)
    pointwise_s: float = 0.0  # eager blocks' unfused pointwise bytes and per-op cost (priced with a measured speed)
    loss_s: float = 0.0  # the chunked loss's lm_head re-run and cross-entropy passes (priced with a measured speed)
    recompute_s: float = 0.0  # what the memory policy re-runs (FLOPs and pointwise bytes)
    source: str = "assumed MFU x datasheet peak"  # where the seconds come from (planning/costs: MEASURED, ...)

    def to_json(self) -> JsonDict:
        """The step-time part of a candidate's JSON row (the reduction by its config name), without the terms."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in TERM_FIELDS}
        return fields | {"reduce_every": self.reduce_every.value}  # in place: the key keeps its position

    def terms_json(self) -> JsonDict:
        """The seconds by term and their source (the JSON adds them after its older keys)."""
        return {name: getattr(self, name) for name in TERM_FIELDS}


# StepTime's seconds by term and their source: written after the rows' older keys (their order is a contract)
TERM_FIELDS = ("matmul_s", "attention_s", "pointwise_s", "loss_s", "recompute_s", "source")


@dataclass(frozen=True)
class Candidate:
    """One evaluated policy: its label and batch shape, the concrete memory config, its bytes and step time."""

    label: str  # e.g. 'block k=16/32', 'ops k=32/32 + offload mb=1'
    micro_batch: int
    grad_accum: int
    k: int  # decoder blocks that recompute or offload
    uses_offload: bool
    memory: MemoryConfig  # concrete: tiles resolved to a number of tokens
    specs: tuple[MemorySpec, ...]  # the memory config as one spec per decoder block: what was priced and runs
    usage: MemoryUse
    time: StepTime

    def to_json(self) -> JsonDict:
        """One row of the plan's candidate table."""
        static = {name: value for name, value in self.usage.terms.items() if name in STATIC_TERMS}
        return {
            "label": self.label,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "k": self.k,
            "uses_offload": self.uses_offload,
            "memory": dataclasses.asdict(self.memory),
            **self.usage.to_json(),
            **self.time.to_json(),
            **static,
            **self.time.terms_json(),
        }


@dataclass(frozen=True)
class Plan:
    """The planner's answer for one precision: the chosen candidate, what it rests on, and every candidate."""

    hf_config: JsonDict  # the model's HF config (to_dict)
    seq_len: int
    precision: str  # the precision mode the bytes come from
    attention_pairs: AttendedPairs  # the attention core's attended pairs per layer and where the count comes from
    dtype: str  # 'bfloat16', 'float32'
    chosen: Candidate  # the cheapest step that fits, else the leanest
    assumptions: dict[str, Optional[float]]  # the constants the estimate rests on (planning/costs.py, budget.py)
    activation_bytes_per_block: dict[str, tuple[int, ...]]  # the first candidate's and the chosen one's, by label
    logits_bytes: int  # the loss's log-probabilities and its transient, at the chosen micro-batch
    pcie_seconds_per_step: float  # the chosen policy's offload traffic at the PCIe bandwidth
    candidates: tuple[Candidate, ...]  # every policy x micro-batch x reduction weighed
    suggestions: tuple[str, ...]  # what would fit, when nothing does

    @property
    def n_layers(self) -> int:
        """The model's decoder blocks."""
        return int(self.hf_config["num_hidden_layers"])

    def to_json(self) -> JsonDict:
        """The plan as `flexengine-plan plan.format=json` writes it (before the command's own fields)."""
        best, usage, time = self.chosen, self.chosen.usage, self.chosen.time
        return {
            "hf_config": copy.deepcopy(self.hf_config),  # the caller may trim it: not the plan's own
            "seq_len": self.seq_len,
            "micro_batch": best.micro_batch,
            "grad_accum": best.grad_accum,
            "reduce_every": best.time.reduce_every.value,
            "precision": self.precision,
            "attention_pairs": self.attention_pairs.as_dict(),
            "dtype": self.dtype,
            "weights_bytes": self.chosen.usage.terms.weights_bytes,
            "grads_bytes": self.chosen.usage.terms.grads_bytes,
            "optimizer_bytes": self.chosen.usage.terms.optimizer_bytes,
            "activation_bytes": self.chosen.usage.terms.activation_bytes,
            "workspace_bytes": usage.workspace_bytes,
            "total_bytes": usage.terms.total_bytes,
            "terms": self.chosen.usage.terms.to_json(),
            **budget_json(usage.budget),
            "host_bytes": usage.host_bytes,
            "host_budget_bytes": usage.host_budget_bytes,
            "offload_pinned_bound_bytes": usage.offload_pinned_bound_bytes,
            "fits": usage.fits,
            "memory": dataclasses.asdict(best.memory),
            **{name: getattr(time, name) for name in PLAN_TIME_FIELDS},
            "assumptions": dict(self.assumptions),
            "activation_bytes_per_block": {k: list(v) for k, v in self.activation_bytes_per_block.items()},
            "logits_bytes": self.logits_bytes,
            "policy": self.chosen.label,
            "pcie_seconds_per_step": self.pcie_seconds_per_step,
            "candidates": [c.to_json() for c in self.candidates],
            "suggestions": list(self.suggestions),
            "step_time_terms": time.terms_json(),  # the chosen step's seconds by term and where they come from
        }


# The device terms a candidate's JSON row repeats after its step time (those that arise), in the terms' order
STATIC_TERMS = ("weights_bytes", "grads_bytes", "optimizer_bytes", "embedding_optimizer_bytes", "compute_copy_bytes")

# The chosen step's time fields the JSON repeats at its top level, in its order
PLAN_TIME_FIELDS = (
    "step_s",
    "optimizer_s",
    "recompute_flops_fraction",
    "recompute_pointwise_s",
    "offload_bytes_per_step",
    "reduce_scatter_bytes_per_step",
    "eager_pointwise_s",
    "reduce_scatter_s",
    "reduce_exposed_s",
)
