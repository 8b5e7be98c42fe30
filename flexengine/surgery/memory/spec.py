"""`MemorySpec`: what one decoder block does with its activations, resolved once from `memory.*`, and what its
recompute costs (its kind's `flops`, memory/kinds.py; `MemorySpec.recompute_flops`): the one definition that both
the planner (planning/activations.py, per micro-batch from the model's shape) and the FLOP counter (loop/flops.py,
per token from the model's own Linear layers) price their block parts with."""

from __future__ import annotations

from dataclasses import dataclass

from flexengine.core.config import MemoryConfig
from flexengine.core.errors import UserError
from flexengine.core.memory_policies import MEMORY_POLICIES
from flexengine.surgery.memory.kinds import KINDS, BlockFlops, RecomputeKind, kind


class Recompute:
    """Short names for the shipped kinds of `KINDS` (memory/kinds.py), and `Recompute(name)` -> the table's kind
    (also a kind added to the table later)."""

    NONE = KINDS["none"]  # keep everything
    BLOCK = KINDS["block"]  # the whole block (keeps only its input)
    ATTENTION = KINDS["attention"]  # the self-attention sub-module
    MLP = KINDS["mlp"]  # the MLP sub-module
    OPS = KINDS["ops"]  # op-level SAC: matmul and attention outputs kept, pointwise ops recomputed

    def __new__(cls, name: str) -> RecomputeKind:  # type: ignore[misc]
        return kind(name)


@dataclass(frozen=True)
class MemorySpec:
    """One decoder block's policy."""

    recompute: RecomputeKind = KINDS["none"]
    offload: bool = False  # saved tensors (under recompute: the checkpoint's inputs) live in host memory
    mlp_tile: int = 0  # the MLP runs over tiles of this many tokens, each recomputed in backward (0 = whole)

    def tiles_mlp(self, tokens: int) -> bool:
        """Whether the MLP really runs in more than one tile over `tokens` (tiled_mlp_forward skips a single tile)."""
        return 0 < self.mlp_tile < tokens

    def recompute_flops(self, f: BlockFlops, mlp_tiled: bool) -> float:
        """Forward FLOPs backward re-runs in this block: its recompute's, plus the MLP's gate/up once more per tile
        when the MLP runs tiled (mlp_tiled: see `tiles_mlp`), each tile being its own checkpoint. Under a
        whole-block checkpoint the tiles' recompute comes on top of the block's (FlopCounterMode on a 3-layer LLaMA,
        128 tokens: the block's re-run + gate/up = 34.6 MFLOP of the 36.2-38.5 counted with 3-8 tiles; the block's
        re-run alone, 22.0, undercounts)."""
        tiles = Recompute.MLP.flops(f) if mlp_tiled else 0.0
        return self.recompute.flops(f) + tiles

    def recomputed_pointwise_ops(self, mlp_tiled: bool) -> tuple[str, ...]:
        """The pointwise ops backward re-runs in this block (an op twice when both the recompute and the tiles do)."""
        return self.recompute.pointwise_ops + (Recompute.MLP.pointwise_ops if mlp_tiled else ())

    @property
    def changes_block(self) -> bool:
        """Whether the block is wrapped at all."""
        return self.recompute.recomputes or self.offload or self.mlp_tile > 0

    def describe(self) -> str:
        """Short label for logs: e.g. 'ops', 'block+offload+mlp_tile4096', 'none'."""
        return (
            self.recompute.name
            + ("+offload" if self.offload else "")
            + (f"+mlp_tile{self.mlp_tile}" if self.mlp_tile else "")
        )


def block_memory_specs(memory: MemoryConfig, n_layers: int) -> tuple[MemorySpec, ...]:
    """memory.* (a concrete policy) -> one MemorySpec per decoder block."""
    from flexengine.surgery.memory.layers import select_layers

    if memory.policy == "auto" or memory.tiled_mlp == "auto":
        raise UserError(
            "memory.policy=auto / memory.tiled_mlp=auto must be resolved to a concrete policy by the planner first "
            "(flexengine.resolve.resolve); run.py does this for training"
        )
    tile = int(memory.tiled_mlp)  # every block's MLP, whichever blocks memory.layers selects
    policy = MEMORY_POLICIES[memory.policy]
    if not policy.chooses_blocks:
        return (MemorySpec(mlp_tile=tile),) * n_layers
    if memory.layers is None or memory.granularity is None or memory.offload is None:
        # MemoryConfig.__post_init__ fills all three under a concrete policy: a None is a config changed after it
        raise ValueError(
            f"memory.layers={memory.layers}, memory.granularity={memory.granularity}, memory.offload="
            f"{memory.offload}: under memory.policy={memory.policy} none may be null; build the config with "
            "MemoryConfig(...) or dataclasses.replace so that its defaults are filled in"
        )
    chosen = set(select_layers(memory.layers, n_layers))
    recompute = Recompute(memory.granularity) if policy.recomputes else Recompute.NONE
    selected = MemorySpec(recompute, offload=policy.offloads or memory.offload, mlp_tile=tile)
    return tuple(selected if i in chosen else MemorySpec(mlp_tile=tile) for i in range(n_layers))
