"""flexengine/core/memory_policies.py: one MemoryPolicy per memory.policy. Each shipped policy's refusals keep their
words; a policy added as one entry alone (a test-only `full_offload`: whole blocks re-run, their inputs in host
memory, as one name) composes, turns into per-block MemorySpecs, is weighed and priced by the planner under
memory=auto, and trains two steps through flexengine.train exactly as memory=full memory.offload=true does."""

from __future__ import annotations

import math
import re

import pytest

from flexengine.core.config import MemoryConfig, ModelConfig
from flexengine.core.errors import UserError
from flexengine.core.memory_policies import MEMORY_POLICIES, MemoryPolicy
from flexengine.planning.planner import plan_memory
from flexengine.planning.shapes import PlanInputs
from flexengine.run import run_training
from flexengine.surgery.memory import MemorySpec, Recompute, block_memory_specs
from flexengine.surgery.model import build_hf_config
from tests.helpers import A100, make_job
from tests.surgery.memory.test_kinds import SEVEN_B

FULL_OFFLOAD = MemoryPolicy(
    "full_offload", recomputes=True, granularity="block", offloads=True
)  # whole blocks re-run, their inputs in host memory


@pytest.fixture
def full_offload(monkeypatch):
    """MEMORY_POLICIES with the test-only policy as one more entry, and nothing else changed."""
    monkeypatch.setitem(MEMORY_POLICIES, FULL_OFFLOAD.name, FULL_OFFLOAD)
    return FULL_OFFLOAD.name


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"policy": "sometimes"},
            "memory.policy='sometimes' is not valid; choose one of none, full, selective, offload, auto.",
        ),
        (
            {"policy": "full", "granularity": "ops"},
            (
                "memory=full recomputes whole blocks, but memory.granularity='ops'; to recompute part of each block "
                "use memory=selective with that granularity (its kinds are checked at composition), or drop "
                "memory.granularity."
            ),
        ),
        *[
            (
                {"policy": policy, "offload": True},
                (
                    f"memory.offload=true offloads checkpoint inputs; memory.policy={policy} has none. Use "
                    "memory=offload to offload every saved tensor, or memory=full memory.offload=true."
                ),
            )
            for policy in ("none", "offload")
        ],
        (
            {"policy": "selective", "granularity": "mlp", "tiled_mlp": 512},
            (
                "memory.tiled_mlp=512 already recomputes the MLP (per tile) and memory.granularity=mlp would recompute "
                "it again around the tiles: use one of them."
            ),
        ),
    ],
)
def test_each_shipped_refusal_keeps_its_words(kwargs, message):
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        MemoryConfig(**kwargs)


def test_the_shipped_policies_compose_as_they_mean():
    assert MemoryConfig(policy="selective", granularity="mlp", offload=True, tiled_mlp=0).offload is True
    assert MemoryConfig(policy="none", granularity="mlp", tiled_mlp=512).tiled_mlp == 512  # none re-runs no MLP
    auto = MemoryConfig(policy="auto")
    assert (auto.layers, auto.granularity, auto.offload) == (None, None, None)  # the planner chooses them
    offload = block_memory_specs(MemoryConfig(policy="offload", layers="every_2"), 4)
    assert offload == (MemorySpec(), MemorySpec(offload=True)) * 2  # the chosen blocks offload, nothing re-runs


def test_a_new_policy_composes_and_means_what_its_entry_says(full_offload, tmp_path):
    job = make_job(tmp_path, f"memory.policy={full_offload}")
    assert (job.memory.policy, job.memory.layers, job.memory.granularity) == (full_offload, "all", "block")
    assert block_memory_specs(MemoryConfig(policy=full_offload), 3) == (MemorySpec(Recompute.BLOCK, offload=True),) * 3
    with pytest.raises(UserError, match=f"memory={full_offload} recomputes whole blocks, but memory.granularity='mlp'"):
        MemoryConfig(policy=full_offload, granularity="mlp")
    with pytest.raises(UserError, match=r"choose one of none, full, selective, offload, full_offload, auto"):
        MemoryConfig(policy="sometimes")


def test_a_new_policy_is_weighed_and_priced_by_the_planner(full_offload):
    cfg = build_hf_config(ModelConfig(init="random", arch=SEVEN_B))
    plan = plan_memory(cfg, PlanInputs(seq_len=8192, micro_batch=1, dtype_bytes=2, hardware=A100))
    rows = {(r.memory.policy, r.memory.layers, r.memory.offload, r.memory.tiled_mlp): r for r in plan.candidates}
    new = {key: row for key, row in rows.items() if key[0] == full_offload}
    assert len(new) == cfg.num_hidden_layers  # one per k = 1..L: the entry's own search (no tiles under auto)
    for (_, layers, offload, tiles), row in new.items():
        full = rows[("full", layers, True, tiles)]  # what it is: memory=full memory.offload=true
        assert row.usage.terms.total_bytes == full.usage.terms.total_bytes and row.time.step_s == full.time.step_s
        assert row.label == full.label and offload is False  # its offload is its own, not memory.offload's


def test_a_new_policy_trains_two_steps_through_the_loop_like_full_with_offload(full_offload, tmp_path):
    runs = {}
    cases = {"new": [f"memory.policy={full_offload}"], "full": ["memory=full", "memory.offload=true"]}
    for name, overrides in cases.items():
        job = make_job(tmp_path / name, *overrides, "train.max_steps=2")
        runs[name] = run_training(job, tmp_path / name)
    new, full = runs["new"], runs["full"]
    assert new["steps"] == 2 and all(math.isfinite(loss) for loss in new["losses"])
    assert new["config"]["memory"]["policy"] == full_offload
    assert new["losses"] == pytest.approx(full["losses"], rel=1e-6)
    assert new["memory_policy"]["policy"] == full_offload  # the fit kept it, and the meter saw what it did:
    assert new["activation_offloaded_bytes"] == full["activation_offloaded_bytes"] > 0
    assert new["activation_bytes_per_block"] == full["activation_bytes_per_block"]
