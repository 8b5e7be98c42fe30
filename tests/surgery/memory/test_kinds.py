"""The recompute kinds table: each shipped kind's own answers, and a test-only kind added as one entry of `KINDS`
that the planner weighs (its rows appear) and that wraps a tiny model's blocks and trains through the Trainer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flexengine.cli.common import compose_job
from flexengine.core.config import JobConfig, MemoryConfig, ModelConfig, OptimConfig, TrainConfig
from flexengine.core.errors import UserError
from flexengine.planning.planner import plan_memory
from flexengine.planning.shapes import PlanInputs
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
from flexengine.surgery.memory.kinds import KINDS, WholeBlock, check_granularity, granularities, kind
from flexengine.surgery.model import build_hf_config
from tests.helpers import A100, make_llama, random_row_loader, trainer_for

SEQ_LEN = 64
SEVEN_B = dict(  # a LLaMA-2-7B-shaped architecture
    model_type="llama",
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
)


@dataclass(frozen=True)
class FinestWholeBlock(WholeBlock):
    """A whole-block checkpoint that the planner's tie-break ranks after every shipped kind."""

    name: str = "finest_block"
    coarseness: int = 9


@pytest.fixture
def new_kind(monkeypatch):
    """The test-only kind as one table entry (the table is the only list of kinds: composition checks
    memory.granularity against it)."""
    added = FinestWholeBlock()
    monkeypatch.setitem(KINDS, added.name, added)
    return added


def test_shipped_kinds_and_their_coarseness():
    assert granularities() == ("block", "attention", "mlp", "ops")
    assert [kind(n).coarseness for n in ("none", "block", "attention", "mlp", "ops")] == [0, 0, 1, 2, 3]


def test_composition_refuses_an_unknown_granularity_naming_the_key_and_the_choices():
    with pytest.raises(
        UserError, match=r"memory.granularity='heads' is not valid; choose one of block, attention, mlp, ops"
    ):
        compose_job(["memory=selective", "memory.granularity=heads"])
    check_granularity(None)  # the planner chooses


def test_new_kind_composes_as_one_table_entry(new_kind):
    job = compose_job(["memory=selective", f"memory.granularity={new_kind.name}"])
    assert job.memory.granularity == new_kind.name


def test_unknown_kind_is_refused_with_the_choices():
    with pytest.raises(UserError, match=r"memory.granularity='heads'[\s\S]*block"):
        kind("heads")


def _family(memory: MemoryConfig) -> tuple:
    return memory.granularity, memory.layers, memory.offload, memory.tiled_mlp


def test_new_kind_is_planned_like_the_kind_it_extends(new_kind):
    cfg = build_hf_config(ModelConfig(init="random", arch=SEVEN_B))
    plan = plan_memory(cfg, PlanInputs(seq_len=8192, micro_batch=1, dtype_bytes=2, hardware=A100))
    rows = {_family(r.memory): r for r in plan.candidates if r.memory.policy in ("full", "selective")}
    new = {key: r for key, r in rows.items() if key[0] == new_kind.name}
    assert len(new) >= cfg.num_hidden_layers  # one per k at least
    for (_, *rest), row in new.items():
        block = rows[("block", *rest)]
        assert row.usage.terms.total_bytes == block.usage.terms.total_bytes and row.time.step_s == block.time.step_s
    assert plan.chosen.memory.granularity != new_kind.name  # ties go to the coarser shipped kind


def _train_losses(memory: MemoryConfig, tmp_path) -> tuple[list[int], list[str], list[float]]:
    """Blocks changed, their classes, and two steps' losses of a tiny model trained under `memory`."""
    model = patch_attention(make_llama(0), mode="packed_doc", backend="dense")
    changed = apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
    job = JobConfig(
        optim=OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.0),
        train=TrainConfig(micro_batch=2, grad_accum=1, max_steps=2, progress=False, save_final=False),
    )
    job.data.seq_len = SEQ_LEN
    trainer = trainer_for(job, model, random_row_loader(2, SEQ_LEN, 60), tmp_path)
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    return changed, [type(layer).__name__ for layer in model.model.layers], losses


def test_new_kind_wraps_blocks_and_trains_two_steps_like_no_recompute(new_kind, tmp_path):
    changed, classes, losses = _train_losses(
        MemoryConfig(policy="selective", granularity=new_kind.name), tmp_path / "a"
    )
    _, _, plain = _train_losses(MemoryConfig(), tmp_path / "b")
    assert changed == list(range(len(classes))) and all(name.startswith("Memory") for name in classes)
    assert losses == pytest.approx(plain, rel=1e-5) and losses[1] != losses[0]
