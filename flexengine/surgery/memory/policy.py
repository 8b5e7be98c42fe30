"""Which decoder blocks recompute or offload their activations in backward, applied in place to an HF model.

Every block that a policy changes gets the same wrapper class, `MemoryBlock` mixed into its own class once per
HF class (the way FSDP2 does it), and its policy as data (`memory_spec`). So all blocks share one compiled
graph whatever the policy -- a per-block class would make each block its own graph and hit the recompile limit
(`FailOnRecompileLimitHit` at 9+ layers under fullgraph). Every policy is non-reentrant, so it composes with
keyword arguments (rotary embeddings, masks), with `torch.compile(fullgraph=True)` on the block, and with
activation offload:
What each kind does is its entry in memory/kinds.py's `KINDS`; the shipped ones:
- Recompute.BLOCK: the whole block is recomputed (saves only its input hidden state);
- Recompute.ATTENTION / MLP: only that sub-module is recomputed (saves its normalised input);
- Recompute.OPS: op-level SAC -- matmul and attention outputs are kept, pointwise ops are recomputed; with
  flex the block must be compiled, so that SAC sees flex inside the block's graph (`compile.needs_compiled_blocks`);
- offload: the block's saved tensors (or, under checkpointing, its saved inputs) live in CPU memory. The hooks
  run in `MemoryBlock.__call__`, outside the compiled forward and outside the checkpoint;
- mlp_tile: the block's `mlp` runs over token tiles, each its own checkpoint (memory/tiled_mlp.py), inside
  whatever the block itself does.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

from torch import nn

from flexengine.core.errors import UserError
from flexengine.core.units import GiB
from flexengine.surgery.applied import applied
from flexengine.surgery.family import Family, family_of
from flexengine.surgery.memory.layers import decoder_layers, select_layers  # noqa: F401  (re-exported)
from flexengine.surgery.memory.offload import DEFAULT_MAX_PINNED_BYTES, OffloadManager
from flexengine.surgery.memory.spec import MemorySpec, Recompute
from flexengine.surgery.memory.tiled_mlp import tiled_mlp_forward

log = logging.getLogger(__name__)


class MemoryBlock(nn.Module):
    """Mixed into a block's (or sub-module's) class: checkpoint / SAC in `forward`, offload in `__call__`.

    Never instantiated: `wrap_module` swaps an existing module's class and sets the three attributes below.
    """

    memory_spec: MemorySpec  # what this module's own forward does (Recompute.BLOCK on a wrapped sub-module)
    memory_index: int  # decoder block index (offload groups prefetch one block ahead)
    memory_offload: Optional[OffloadManager]  # the model's offload manager, when this module offloads

    # Any: the arguments and the output are the HF block's own (hidden states, masks, rotary embeddings, ...)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.memory_spec.mlp_tile:  # on the block's `mlp` (apply_block_spec): hidden states in, per token
            return tiled_mlp_forward(super().forward, *args, tile_tokens=self.memory_spec.mlp_tile, **kwargs)
        return self.memory_spec.recompute.checkpoint_forward(super().forward, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Outside the compiled region (nn.Module.compile compiles _call_impl, which __call__ calls) and outside
        # the checkpoint (hooks inside one would disable it; here they see only its positional inputs).
        if self.memory_offload is None:
            return super().__call__(*args, **kwargs)
        with self.memory_offload.block(self.memory_index, kwargs):
            return super().__call__(*args, **kwargs)


_MEMORY_CLASSES: dict[type, type] = {}


def wrap_module(module: nn.Module, spec: MemorySpec, index: int, offload: Optional[OffloadManager]) -> None:
    """Give `module` the shared MemoryBlock class of its HF class and this policy (idempotent)."""
    cls = type(module)
    if not isinstance(module, MemoryBlock):
        if cls not in _MEMORY_CLASSES:
            _MEMORY_CLASSES[cls] = type(f"Memory{cls.__name__}", (MemoryBlock, cls), {})
        module.__class__ = _MEMORY_CLASSES[cls]  # parameter names and state_dict keys stay HF's
    assert isinstance(module, MemoryBlock)  # its class is now one (and the type checker knows its three fields)
    module.memory_spec, module.memory_index, module.memory_offload = spec, index, offload


def _submodule(layer: nn.Module, name: str, setting: str, instead: str) -> nn.Module:
    """layer's sub-module `name`, or a UserError naming the `setting` that needs it and what to use `instead`."""
    sub = getattr(layer, name, None)
    if not isinstance(sub, nn.Module):
        raise UserError(f"{setting}: {type(layer).__name__} has no `{name}` sub-module{instead}")
    return sub


def apply_block_spec(
    layer: nn.Module, spec: MemorySpec, index: int, offload: Optional[OffloadManager], family: Family
) -> None:
    """Apply one block's MemorySpec in place (a block whose spec changes nothing is left as it is)."""
    if not spec.changes_block and not isinstance(layer, MemoryBlock):
        return
    sub = spec.recompute.submodule(family)
    if sub is not None:
        setting = f"memory.granularity={spec.recompute.name}"
        module = _submodule(layer, sub.module, setting, "; use memory.granularity=block")
        wrap_module(module, MemorySpec(Recompute.BLOCK), index, None)
    if spec.mlp_tile:
        mlp = _submodule(
            layer, family.mlp.module, f"memory.tiled_mlp={spec.mlp_tile}", " to tile; use memory.tiled_mlp=0"
        )
        wrap_module(mlp, MemorySpec(mlp_tile=spec.mlp_tile), index, None)
    own = dataclasses.replace(spec, mlp_tile=0)  # the tiles belong to the mlp's forward, not the block's
    if own.changes_block or isinstance(layer, MemoryBlock):
        wrap_module(layer, own, index, offload if spec.offload else None)


def apply_memory_policy(
    model: nn.Module, specs: Sequence[MemorySpec], max_pinned_bytes: Optional[int] = None
) -> list[int]:
    """Apply one MemorySpec per decoder block in place (recorded in `model.flexengine.memory`); returns the indices
    of the blocks it changed. specs: the ones the fit chose (`ResolvedRun.memory_specs`), or any memory.* as
    `block_memory_specs(memory, n_layers)` -- the planner's own conversion, so what runs is what was priced.

    max_pinned_bytes: offload's bound on pinned host memory (the plan's `offload_pinned_bound_bytes`, from the
    rank's host budget); None = offload.DEFAULT_MAX_PINNED_BYTES (library use without a plan)."""
    family = family_of(model)
    layers = family.decoder_layers(model)
    specs = tuple(specs)
    if len(specs) != len(layers):
        raise ValueError(f"apply_memory_policy: {len(specs)} MemorySpecs for a model of {len(layers)} decoder blocks")
    record = applied(model)
    if any(s.offload for s in specs) and record.offload is None:
        bound = DEFAULT_MAX_PINNED_BYTES if max_pinned_bytes is None else max_pinned_bytes
        record.offload = OffloadManager(max_pinned_bytes=bound)  # one manager (one side stream) per model
        log.info(
            "memory: activation offload pins at most %.1f GiB of host memory on this rank (%s)",
            bound / GiB,
            "the plan's host budget less host optimizer state"
            if max_pinned_bytes is not None
            else "default bound: no host budget given",
        )
    for i, (layer, spec) in enumerate(zip(layers, specs)):
        apply_block_spec(layer, spec, i, record.offload, family)
    record.memory = specs
    chosen = [i for i, s in enumerate(specs) if s.changes_block]
    if chosen:
        described = sorted({specs[i].describe() for i in chosen})
        log.info("memory: %s on %d of %d blocks %s", ", ".join(described), len(chosen), len(layers), chosen)
    return chosen
