"""`MemorySpec`: what one decoder block does with its activations, resolved once from `memory.*`, and what its
recompute costs (`Recompute.flops`, `MemorySpec.recompute_flops`): the one definition that both the planner
(planning/activations.py, per micro-batch from the model's shape) and the FLOP counter (loop/flops.py, per token
from the model's own Linear layers) price their block parts with."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from flexengine.core.config import MemoryConfig
from flexengine.core.errors import UserError


@dataclass(frozen=True)
class BlockFlops:
    """Forward FLOPs of the parts of one decoder block a recompute can re-run, in the caller's unit (per token, or
    per micro-batch). Non-reentrant checkpointing stops re-running once the last tensor backward needs exists, so a
    checkpointed region's final projection (o_proj / down_proj, whose output nothing saves: a residual add follows)
    re-runs only in part, when a trainable LoRA factor after it saves lora_A's output: the `*_end` fields."""

    attention_inputs: float  # q, k and v projections
    attention_core: float  # QK^T and PV (0 where the caller counts the core per layer itself: loop/flops.py)
    attention_output: float  # o_proj whole: re-run inside a whole-block checkpoint, where the MLP follows it
    mlp_inputs: float  # gate and up projections
    attention_output_end: float = 0.0  # o_proj where the checkpoint ends with it (0 without trainable LoRA)
    mlp_output_end: float = 0.0  # down_proj, always where its checkpoint ends (0 without trainable LoRA)


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

    @property
    def reruns_attention_core(self) -> bool:
        """Whether backward re-runs the attention core (op-level SAC keeps its output)."""
        return self in (Recompute.BLOCK, Recompute.ATTENTION)

    def flops(self, f: BlockFlops) -> float:
        """Forward FLOPs backward re-runs in one block checkpointed at this granularity. ops (SAC) keeps every matmul
        and the attention output: 0 FLOPs (its cost is the pointwise ops' memory traffic: `pointwise_ops`)."""
        attention = f.attention_inputs + f.attention_core
        mlp = f.mlp_inputs + f.mlp_output_end
        if self is Recompute.BLOCK:
            return attention + f.attention_output + mlp
        if self is Recompute.ATTENTION:
            return attention + f.attention_output_end
        if self is Recompute.MLP:
            return mlp
        return 0.0

    @property
    def pointwise_ops(self) -> tuple[str, ...]:
        """The pointwise ops of a LLaMA block (planning.activations.pointwise_bytes' names) this re-runs: a checkpoint
        around self_attn / mlp leaves the norms and residual adds outside; op-level SAC re-runs every one."""
        return _POINTWISE_OPS[self]


_EVERY_POINTWISE_OP = ("norm1", "rope", "norm2", "swiglu", "residual")
_POINTWISE_OPS = {
    Recompute.NONE: (),
    Recompute.BLOCK: _EVERY_POINTWISE_OP,
    Recompute.OPS: _EVERY_POINTWISE_OP,
    Recompute.ATTENTION: ("rope",),
    Recompute.MLP: ("swiglu",),
}


@dataclass(frozen=True)
class MemorySpec:
    """One decoder block's policy."""

    recompute: Recompute = Recompute.NONE
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
