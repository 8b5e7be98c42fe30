"""The recompute kinds, one object each in one table (`KINDS`), like attention's `MODES`: what part of a decoder
block backward re-runs, and everything that follows from it -- its coarseness (the planner's tie-break), whether
its checkpoint holds the attention call, which pointwise ops and forward FLOPs it re-runs, the bytes a block keeps
and re-materialises in backward (from the inventories the planner passes in), and how it wraps a block. Torch-free
at import: only `checkpoint_forward` imports torch, when a model runs. A new kind is one entry in `KINDS`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from flexengine.core.config import check_choice
from flexengine.core.errors import UserError

if TYPE_CHECKING:
    from flexengine.surgery.family import Family, Sublayer


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


Inventory = dict[str, dict[str, int]]  # planning.activations.block_inventory: bytes by sub-layer and tensor

EVERY_POINTWISE_OP = ("norm1", "rope", "norm2", "swiglu", "residual")


@dataclass(frozen=True)
class RecomputeKind:
    """Nothing re-runs: the block keeps every activation (also the base of every kind)."""

    name: str = "none"
    coarseness: int = 0  # tie-break among equally fast plans, coarsest first; none ranks with whole blocks
    wraps_attention: bool = False  # the checkpoint's closure keeps the attention kwargs (dense mask) alive
    reruns_attention_core: bool = False  # backward re-runs QK^T / PV
    pointwise_ops: tuple[str, ...] = ()  # planning.activations.pointwise_bytes' names this re-runs
    whole_block: bool = False  # checkpointed whole or op by op: autograd saves nothing of the block itself
    working_rank: int = 0  # how much backward re-materialises: 0 kept (none) < 1 op-level < 2 re-run sub-layers
    keeps_tile_outputs: bool = False  # MLP tiles' matmul outputs still land in this kind's cache (SAC)
    needs_flex_in_block_graph: bool = False  # flex must be compiled inside the block for this kind to save it
    # eager, what it keeps lives in its own cache, not in autograd's saved tensors: offload's saved-tensor hooks
    # never see it (compiled, it is the block graph's saved tensors and goes to the host)
    cache_outside_autograd: bool = False

    @property
    def recomputes(self) -> bool:
        """Whether backward re-runs anything (False only for `none`)."""
        return self.working_rank > 0

    def flops(self, f: BlockFlops) -> float:
        """Forward FLOPs backward re-runs in one block checkpointed this way."""
        return 0.0

    def held_bytes(self, inv: Inventory, sac: dict[str, int], input_bytes: int) -> int:
        """Bytes one block holds for backward: its whole inventory."""
        return sum(sum(part.values()) for part in inv.values())

    def working(self, inv: Inventory, mlp: dict[str, int], kept_gradients: int) -> tuple[Inventory, int]:
        """(what backward re-materialises outside the MLP, the MLP's peak) beside what the forward holds: nothing
        re-runs, only the MLP's gradients are in flight."""
        return {}, kept_gradients

    def submodule(self, family: Family) -> Optional[Sublayer]:
        """The family's sub-module this kind checkpoints alone (None: the block's own forward does the work)."""
        return None

    def checkpoint_forward(self, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run a wrapped module's forward under this kind (plain here: a sub-module kind recomputes itself)."""
        return forward(*args, **kwargs)


@dataclass(frozen=True)
class WholeBlock(RecomputeKind):
    """The whole block re-runs; it keeps only its input hidden state."""

    name: str = "block"
    wraps_attention: bool = True
    reruns_attention_core: bool = True
    pointwise_ops: tuple[str, ...] = EVERY_POINTWISE_OP
    whole_block: bool = True
    working_rank: int = 2

    def flops(self, f: BlockFlops) -> float:
        """q/k/v, the core, o_proj whole (the MLP follows it) and the MLP."""
        return f.attention_inputs + f.attention_core + f.attention_output + f.mlp_inputs + f.mlp_output_end

    def held_bytes(self, inv: Inventory, sac: dict[str, int], input_bytes: int) -> int:
        """The checkpoint's input."""
        return input_bytes

    def working(self, inv: Inventory, mlp: dict[str, int], kept_gradients: int) -> tuple[Inventory, int]:
        """The whole inventory re-run; the MLP with two [tokens, intermediate] gradients in flight (~6 tensors)."""
        return inv, sum(mlp.values()) * 6 // 4

    def checkpoint_forward(self, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        """Non-reentrant: works with kwargs, compile and offload hooks."""
        from torch.utils.checkpoint import checkpoint

        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@dataclass(frozen=True)
class SubModule(WholeBlock):
    """One sub-module (the family's `part`) re-runs; it keeps only its input, the norm's output."""

    part: str = "attention"  # block_inventory's sub-layer, and the Family field naming the module
    norm: str = "norm1"  # the norm whose output is its input
    whole_block: bool = False

    def held_bytes(self, inv: Inventory, sac: dict[str, int], input_bytes: int) -> int:
        """Everything but that sub-layer, whose input is the norm's scaled output (autocast's casts re-run)."""
        inv[self.norm]["scaled_output"] = input_bytes
        return sum(sum(values.values()) for name, values in inv.items() if name != self.part)

    def submodule(self, family: Family) -> Optional[Sublayer]:
        """The family's attention or MLP module."""
        return getattr(family, self.part)

    def checkpoint_forward(self, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        """The block runs plainly; its sub-module carries a whole-block checkpoint of its own."""
        return forward(*args, **kwargs)


@dataclass(frozen=True)
class AttentionModule(SubModule):
    """The self-attention sub-module re-runs."""

    name: str = "attention"
    coarseness: int = 1
    pointwise_ops: tuple[str, ...] = ("rope",)

    def flops(self, f: BlockFlops) -> float:
        """q/k/v, the core, and o_proj only where it ends the checkpoint (a LoRA factor after it saves)."""
        return f.attention_inputs + f.attention_core + f.attention_output_end


@dataclass(frozen=True)
class MlpModule(SubModule):
    """The MLP sub-module re-runs (also what each MLP tile re-runs)."""

    name: str = "mlp"
    coarseness: int = 2
    wraps_attention: bool = False
    reruns_attention_core: bool = False
    pointwise_ops: tuple[str, ...] = ("swiglu",)
    part: str = "mlp"
    norm: str = "norm2"

    def flops(self, f: BlockFlops) -> float:
        """gate/up, and down_proj's end where a LoRA factor after it saves."""
        return f.mlp_inputs + f.mlp_output_end


@dataclass(frozen=True)
class OpLevel(WholeBlock):
    """Op-level SAC: matmul and attention outputs are kept, pointwise ops re-run (0 FLOPs: memory-bound)."""

    name: str = "ops"
    coarseness: int = 3
    reruns_attention_core: bool = False
    working_rank: int = 1
    keeps_tile_outputs: bool = True
    needs_flex_in_block_graph: bool = True  # SAC sees the flex op only inside the block's compiled graph
    cache_outside_autograd: bool = True  # SAC's cache of kept op outputs

    def flops(self, f: BlockFlops) -> float:
        """Every matmul and the attention output are kept: nothing compute-bound re-runs."""
        return 0.0

    def held_bytes(self, inv: Inventory, sac: dict[str, int], input_bytes: int) -> int:
        """Its input plus every matmul and attention output (planning.activations.sac_inventory)."""
        return sum(sac.values())

    def working(self, inv: Inventory, mlp: dict[str, int], kept_gradients: int) -> tuple[Inventory, int]:
        """The whole block's, less what SAC's cache holds (v, attention output, log-sum-exp, gate and up)."""
        for name in ("v", "attn_out", "logsumexp"):
            inv["attention"].pop(name)
        return inv, sum(mlp.values()) * 6 // 4 - mlp["gate"] - mlp["up"]

    def checkpoint_forward(self, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        """Non-reentrant checkpoint with the SAC policy of memory/sac.py."""
        from torch.utils.checkpoint import checkpoint

        from flexengine.surgery.memory.sac import sac_context

        return checkpoint(forward, *args, use_reentrant=False, context_fn=sac_context, **kwargs)


KINDS: dict[str, RecomputeKind] = {
    kind.name: kind
    for kind in (
        RecomputeKind(),
        WholeBlock(),
        AttentionModule(),
        MlpModule(),
        OpLevel(),
    )
}


def kind(name: str) -> RecomputeKind:
    """The table's kind called `name` (memory.granularity, or 'none')."""
    if name not in KINDS:
        raise UserError(f"memory.granularity={name!r} is not a recompute kind; choose one of {granularities()}")
    return KINDS[name]


def granularities() -> tuple[str, ...]:
    """Every kind that recomputes something, in table order: what memory.granularity may name."""
    return tuple(name for name, k in KINDS.items() if k.recomputes)


def check_granularity(granularity: Optional[str]) -> None:
    """memory.granularity names a kind of this table (None: the planner chooses, or `block`), else a UserError
    naming the key and the choices. Checked where a job is composed (cli/common.py) and where a hand-built job
    enters (run.py): core's MemoryConfig lists no kind names, so a new kind is one `KINDS` entry."""
    if granularity is not None:
        check_choice("memory.granularity", granularity, granularities())
