"""The plan as a typed, frozen value (flexengine/planning/plan.py): its fields agree with one another, and its JSON
keeps the keys (and their order) users' scripts read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flexengine.core.config import ModelConfig
from flexengine.planning.budget import device_budget
from flexengine.planning.plan import Candidate, DeviceTerms, Plan
from flexengine.planning.planner import plan_memory
from flexengine.planning.shapes import PlanInputs
from flexengine.surgery.model import build_hf_config
from tests.helpers import A100

TINY = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=2048,
)

# The plan's JSON keys as users' scripts read them (flexengine-plan plan.format=json), in their order
PLAN_KEYS = [
    "hf_config",
    "seq_len",
    "micro_batch",
    "grad_accum",
    "reduce_every",
    "precision",
    "attention_pairs",  # added with the mask modes' pair count: the one new key, nothing renamed
    "dtype",
    "weights_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "workspace_bytes",
    "total_bytes",
    "terms",
    "budget_bytes",
    "card_bytes",
    "cuda_context_bytes",
    "margin_bytes",
    "host_bytes",
    "host_budget_bytes",
    "offload_pinned_bound_bytes",
    "fits",
    "memory",
    "step_s",
    "optimizer_s",
    "recompute_flops_fraction",
    "recompute_pointwise_s",
    "offload_bytes_per_step",
    "reduce_scatter_bytes_per_step",
    "eager_pointwise_s",
    "reduce_scatter_s",
    "reduce_exposed_s",
    "assumptions",
    "activation_bytes_per_block",
    "logits_bytes",
    "policy",
    "pcie_seconds_per_step",
    "candidates",
    "suggestions",
    "step_time_terms",
]
# One candidate row's keys; adamw_8bit adds embedding_optimizer_bytes and autocast compute_copy_bytes at the end
CANDIDATE_KEYS = [
    "label",
    "micro_batch",
    "grad_accum",
    "k",
    "uses_offload",
    "memory",
    "activation_bytes",
    "offloaded_bytes",
    "workspace_bytes",
    "total_bytes",
    "budget_bytes",
    "card_bytes",
    "cuda_context_bytes",
    "margin_bytes",
    "host_bytes",
    "host_budget_bytes",
    "offload_pinned_bound_bytes",
    "fits",
    "terms",
    "recompute_flops_fraction",
    "recompute_pointwise_s",
    "offload_bytes_per_step",
    "offload_exposed_s",
    "optimizer_s",
    "host_optimizer_pcie_bytes_per_step",
    "reduce_every",
    "eager_pointwise_s",
    "reduce_scatter_bytes_per_step",
    "reduce_scatter_s",
    "reduce_exposed_s",
    "step_s",
    "cost",
    "weights_bytes",
    "grads_bytes",
    "optimizer_bytes",
]
# the seconds by term and their source, after every older key (and after the optional byte terms)
STEP_TERM_KEYS = ["matmul_s", "attention_s", "pointwise_s", "loss_s", "recompute_s", "source"]
CANDIDATE_KEYS += STEP_TERM_KEYS
TERM_KEYS = ["weights_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "backward_workspace_bytes"]
TERM_KEYS += ["offload_in_flight_bytes"]
FSDP_TERM_KEYS = ["fsdp_gathered_weights_bytes", "fsdp_unsharded_grads_bytes"]


def _plan(**inputs) -> Plan:
    x = dict(seq_len=2048, micro_batch=2, grad_accum=2, dtype_bytes=2, hardware=A100, chunk_size=1024)
    return plan_memory(build_hf_config(ModelConfig(init="random", arch=TINY)), PlanInputs(**{**x, **inputs}))


def test_plan_json_keeps_its_keys_and_their_order():
    body = _plan().to_json()
    assert list(body) == PLAN_KEYS
    assert list(body["terms"]) == TERM_KEYS
    assert all(list(row) == CANDIDATE_KEYS for row in body["candidates"])
    assert all(list(row["terms"]) == TERM_KEYS for row in body["candidates"])
    assert list(body["memory"]) == ["policy", "layers", "granularity", "offload", "tiled_mlp"]
    json.dumps(body)  # plain JSON: no dataclass or enum left inside


def test_optional_terms_appear_only_where_they_arise():
    eight = dataclasses.replace(A100, world_size=8)
    body = _plan(hardware=eight, embedding_state_bytes=4, compute_copy_bytes=2).to_json()
    assert list(body) == PLAN_KEYS
    terms = TERM_KEYS[:3] + ["embedding_optimizer_bytes", "compute_copy_bytes"] + TERM_KEYS[3:] + FSDP_TERM_KEYS
    assert list(body["terms"]) == terms
    row = body["candidates"][0]
    optional = ["embedding_optimizer_bytes", "compute_copy_bytes"]
    assert list(row) == CANDIDATE_KEYS[: -len(STEP_TERM_KEYS)] + optional + STEP_TERM_KEYS
    assert row["embedding_optimizer_bytes"] == row["terms"]["embedding_optimizer_bytes"] > 0


def test_the_plan_repeats_its_chosen_candidate():
    plan = _plan()
    body = plan.to_json()
    chosen = next(row for row in body["candidates"] if row["label"] == body["policy"])
    assert chosen == plan.chosen.to_json() and plan.chosen in plan.candidates
    same = [k for k in PLAN_KEYS if k in CANDIDATE_KEYS and k != "label"]
    assert {k: body[k] for k in same} == {k: chosen[k] for k in same}
    assert (plan.chosen.label, plan.chosen.memory, plan.chosen.time.step_s) == (
        plan.chosen.label,
        plan.chosen.memory,
        plan.chosen.time.step_s,
    )
    assert plan.chosen.usage.budget == device_budget(A100) and body["budget_bytes"] == device_budget(A100).usable_bytes
    assert list(body["activation_bytes_per_block"]) == list(dict.fromkeys(["none", plan.chosen.label]))
    assert len(body["activation_bytes_per_block"]["none"]) == plan.n_layers == 4


def test_terms_sum_to_the_planned_peak():
    terms = DeviceTerms(
        weights_bytes=1,
        grads_bytes=2,
        optimizer_bytes=4,
        activation_bytes=8,
        backward_workspace_bytes=16,
        offload_in_flight_bytes=0,
        fsdp_unsharded_grads_bytes=32,
    )
    assert terms.total_bytes == 63 and terms.items()[-1] == ("fsdp_unsharded_grads_bytes", 32)
    assert "fsdp_gathered_weights_bytes" not in terms.to_json()  # does not arise: left out, not written as null
    for row in _plan().candidates:
        assert row.usage.terms.total_bytes == sum(row.usage.terms.to_json().values())


def test_plan_and_candidates_are_frozen():
    plan = _plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.seq_len = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.chosen.label = "x"  # type: ignore[misc]
    assert isinstance(plan.candidates, tuple) and all(isinstance(c, Candidate) for c in plan.candidates)
