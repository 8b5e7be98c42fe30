"""`ParallelSpec`: parallel.* resolved once into enums, what the loop and the planner compare.

The config keeps the user's strings (parallel.strategy, parallel.reduce_every); below the composition root code
compares these enums, so a misspelled choice fails once, at composition, and nothing else parses the names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class Strategy(Enum):
    """How a torchrun job splits the model over its ranks."""

    FSDP = "fsdp"  # FSDP2 fully_shard per decoder block + root
    DDP = "ddp"  # a full replica per rank


class ReduceEvery(Enum):
    """When FSDP reduce-scatters gradients over an accumulation window."""

    AUTO = "auto"  # the planner weighs both (flexengine.planning.planner); the loop gets its choice
    WINDOW = "window"  # once, in the last micro-batch's backward (unsharded gradients live through the window)
    MICRO_BATCH = "micro_batch"  # in every backward (grad_accum x the traffic, one block's gradient at a time)


class ParallelChoices(Protocol):
    """The parallel.* fields resolved here (core/config.ParallelConfig, which imports this module's choices)."""

    strategy: str
    reduce_every: str
    cp: int
    mixed_precision: bool
    reshard_after_forward: bool


@dataclass(frozen=True)
class ParallelSpec:
    """The parallel choices a plan and the loop read, as enums (`resolve_parallel`)."""

    strategy: Strategy = Strategy.FSDP
    reduce_every: ReduceEvery = ReduceEvery.WINDOW
    cp: int = 1  # context-parallel degree: ranks sharing each row
    mixed_precision: bool = True  # parallel.mixed_precision: FSDP casts under the precision mode's policy (CUDA)
    reshard_after_forward: bool = True  # parallel.reshard_after_forward: FSDP frees gathered block weights

    @property
    def reduces_every_micro_batch(self) -> bool:
        """Whether every backward reduces gradients (else only the window's last one)."""
        return self.reduce_every is ReduceEvery.MICRO_BATCH


def resolve_parallel(parallel: ParallelChoices) -> ParallelSpec:
    """parallel.* -> ParallelSpec. DDP keeps full gradients either way, so its reduce_every=auto is `window`
    (reducing per micro-batch would only add traffic); FSDP's auto stays for the planner to weigh."""
    strategy, reduce_every = Strategy(parallel.strategy), ReduceEvery(parallel.reduce_every)
    if strategy is Strategy.DDP and reduce_every is ReduceEvery.AUTO:
        reduce_every = ReduceEvery.WINDOW
    return ParallelSpec(strategy, reduce_every, parallel.cp, parallel.mixed_precision, parallel.reshard_after_forward)
