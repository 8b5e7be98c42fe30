"""parallel.* resolved into enums once: the loop and the planner compare these, never the config's strings."""

from __future__ import annotations

import pytest

from flexengine.core.config import REDUCE_EVERY, ParallelConfig
from flexengine.core.errors import UserError
from flexengine.core.parallel_spec import ParallelSpec, ReduceEvery, Strategy, resolve_parallel


def test_the_config_choices_are_the_enums_values():
    assert tuple(r.value for r in ReduceEvery) == REDUCE_EVERY
    with pytest.raises(UserError, match="parallel.reduce_every='sometimes'"):
        ParallelConfig(reduce_every="sometimes")
    with pytest.raises(UserError, match="parallel.strategy='zero3'"):
        ParallelConfig(strategy="zero3")


@pytest.mark.parametrize(
    ("strategy", "reduce_every", "resolved"),
    [
        ("fsdp", "auto", ReduceEvery.AUTO),  # the planner weighs both
        ("fsdp", "micro_batch", ReduceEvery.MICRO_BATCH),
        ("ddp", "auto", ReduceEvery.WINDOW),  # DDP keeps full gradients either way: one reduction per window
        ("ddp", "micro_batch", ReduceEvery.MICRO_BATCH),
    ],
)
def test_resolve_parallel(strategy, reduce_every, resolved):
    config = ParallelConfig(strategy=strategy, reduce_every=reduce_every, mixed_precision=False, cp=1)
    spec = resolve_parallel(config)
    assert spec == ParallelSpec(Strategy(strategy), resolved, 1, False, config.reshard_after_forward)
    assert spec.reduces_every_micro_batch == (resolved is ReduceEvery.MICRO_BATCH)
