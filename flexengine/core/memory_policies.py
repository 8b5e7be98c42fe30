"""The memory.policy values, one `MemoryPolicy` each in one table (`MEMORY_POLICIES`), as memory/kinds.py's `KINDS`
holds the recompute kinds: the memory.* it composes with (MemoryConfig checks when built), what the blocks
memory.layers chooses do (surgery/memory/spec.block_memory_specs) and what memory=auto weighs of it
(planning/planner.search_space). Torch-free, in core: composing a job reads it. A new policy is one entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from flexengine.core.errors import UserError


class MemoryFields(Protocol):
    """The memory.* fields a policy reads: core/config.MemoryConfig's (which imports this table)."""

    layers: Optional[str]
    granularity: Optional[str]
    offload: Optional[bool]
    tiled_mlp: Any


@dataclass(frozen=True)
class MemoryPolicy:
    """One memory.policy: what its chosen blocks do, what it composes with, what memory=auto weighs of it."""

    name: str
    recomputes: bool = False  # the chosen blocks re-run in backward, at memory.granularity
    offloads: bool = False  # the chosen blocks keep every saved tensor in host memory
    offloads_inputs: bool = False  # memory.offload=true: its checkpoints' inputs live in host memory too
    granularity: Optional[str] = None  # the one recompute kind it takes: "block" (None: memory.granularity's)
    tiles_when_auto: bool = False  # memory.tiled_mlp=auto weighs it tiled: the MLP's whole-row tensors still live

    @property
    def chooses_blocks(self) -> bool:
        """Whether memory.layers picks blocks it changes (none changes none)."""
        return self.recomputes or self.offloads

    def check(self, memory: MemoryFields) -> None:
        """Refuse the memory.* it does not compose with (MemoryConfig has filled in its defaults)."""
        if self.granularity is not None and memory.granularity != self.granularity:
            raise UserError(
                f"memory={self.name} recomputes whole blocks, but memory.granularity={memory.granularity!r}; to "
                "recompute part of each block use memory=selective with that granularity (its kinds are checked at "
                "composition), or drop memory.granularity."
            )
        if memory.offload and not self.offloads_inputs:
            raise UserError(
                f"memory.offload=true offloads checkpoint inputs; memory.policy={self.name} has none. "
                "Use memory=offload to offload every saved tensor, or memory=full memory.offload=true."
            )
        if memory.tiled_mlp and not self.tiles_mlp(memory.granularity):
            raise UserError(
                f"memory.tiled_mlp={memory.tiled_mlp} already recomputes the MLP (per tile) and "
                "memory.granularity=mlp would recompute it again around the tiles: use one of them."
            )

    def tiles_mlp(self, granularity: Optional[str]) -> bool:
        """Whether its MLP may run over tiles: not where it recomputes the MLP whole around them."""
        return not (self.recomputes and granularity == "mlp")

    def searched(
        self, layers: Optional[str], granularities: Sequence[str], offloads: Sequence[bool], given: MemoryFields
    ) -> list[dict[str, Any]]:
        """The MemoryConfig fields memory=auto weighs of it on `layers` (None: no block), keeping what the user
        gave (`given`; `granularities` and `offloads` are what that leaves open). A granularity another entry fixes
        is that entry's candidate, not this one's: selective weighs every kind but full's block."""
        if layers is None:  # no block: the policy that changes none, unless the user fixed blocks or offload
            keeps = not self.chooses_blocks and given.layers is None and given.offload is not True
            return [{"policy": self.name}] if keeps else []
        if not self.chooses_blocks or (self.offloads and True not in offloads):  # memory.offload=false rules it out
            return []
        if not self.recomputes:  # plain offload: weighed unless the user fixed a granularity
            return [{"policy": self.name, "layers": layers}] if given.granularity is None else []
        fixed = {p.granularity for p in MEMORY_POLICIES.values() if p is not self}  # other policies' to weigh
        grans = [g for g in granularities if g == self.granularity or (self.granularity is None and g not in fixed)]
        flags = [off for off in offloads if self.offloads_inputs] or [False]  # memory.offload where it takes one
        return [dict(policy=self.name, layers=layers, granularity=g, offload=off) for g in grans for off in flags]


# in the order memory=auto weighs them on each number of blocks (the plan's candidate order)
MEMORY_POLICIES: dict[str, MemoryPolicy] = {
    p.name: p
    for p in (
        MemoryPolicy("none"),  # every block keeps all its activations
        MemoryPolicy("full", recomputes=True, granularity="block", offloads_inputs=True, tiles_when_auto=True),
        MemoryPolicy("selective", recomputes=True, offloads_inputs=True),  # the memory.granularity part re-runs
        MemoryPolicy("offload", offloads=True),  # every saved tensor in host memory, nothing re-runs
    )
}
