"""`MemorySpec`: what one decoder block does with its activations, resolved once from `memory.*`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from flexengine.core.config import MemoryConfig
from flexengine.core.errors import UserError


class Recompute(Enum):
    """Which part of a block backward re-runs (the rest keeps its activations)."""

    NONE = "none"  # keep everything
    BLOCK = "block"  # the whole block (keeps only its input)
    ATTENTION = "attention"  # the self-attention sub-module
    MLP = "mlp"  # the MLP sub-module
    OPS = "ops"  # op-level SAC: matmul and attention outputs kept, pointwise ops recomputed

    @property
    def wraps_attention(self) -> bool:
        """Whether the checkpointed region holds the attention call, so its closure keeps the attention kwargs
        (the dense backend's mask) alive until backward."""
        return self in (Recompute.BLOCK, Recompute.ATTENTION, Recompute.OPS)


@dataclass(frozen=True)
class MemorySpec:
    """One decoder block's policy."""

    recompute: Recompute = Recompute.NONE
    offload: bool = False  # saved tensors (under recompute: the checkpoint's inputs) live in host memory
    mlp_tile: int = 0  # the MLP runs over tiles of this many tokens, each recomputed in backward (0 = whole)

    def tiles_mlp(self, tokens: int) -> bool:
        """Whether the MLP really runs in more than one tile over `tokens` (tiled_mlp_forward skips a single tile)."""
        return 0 < self.mlp_tile < tokens

    @property
    def changes_block(self) -> bool:
        """Whether the block is wrapped at all."""
        return self.recompute is not Recompute.NONE or self.offload or self.mlp_tile > 0

    def describe(self) -> str:
        """Short label for logs: e.g. 'ops', 'block+offload+mlp_tile4096', 'none'."""
        return (
            self.recompute.value
            + ("+offload" if self.offload else "")
            + (f"+mlp_tile{self.mlp_tile}" if self.mlp_tile else "")
        )


def block_memory_specs(memory: MemoryConfig, n_layers: int) -> tuple[MemorySpec, ...]:
    """memory.* (a concrete policy) -> one MemorySpec per decoder block."""
    from flexengine.surgery.memory.layers import select_layers

    if memory.policy == "auto" or memory.tiled_mlp == "auto":
        raise UserError(
            "memory.policy=auto / memory.tiled_mlp=auto must be resolved to a concrete policy by the planner first "
            "(flexengine.planning.fit.fit_job); run.py does this for training"
        )
    tile = int(memory.tiled_mlp)  # every block's MLP, whichever blocks memory.layers selects
    if memory.policy == "none":
        return (MemorySpec(mlp_tile=tile),) * n_layers
    chosen = set(select_layers(memory.layers, n_layers))
    recompute = Recompute(memory.granularity) if memory.policy in ("full", "selective") else Recompute.NONE
    selected = MemorySpec(recompute, offload=memory.policy == "offload" or memory.offload, mlp_tile=tile)
    return tuple(selected if i in chosen else MemorySpec(mlp_tile=tile) for i in range(n_layers))
