"""Which decoder blocks recompute or offload their activations in backward, applied in place to an HF model.

Every policy works per selected block and is non-reentrant, so it composes with keyword arguments (rotary
embeddings, masks), with `torch.compile(fullgraph=True)` on the block, and with activation offload:
- granularity=block: the whole block is recomputed (saves only its input hidden state);
- granularity=attention / mlp: only that sub-module is recomputed (saves its normalised input);
- granularity=ops: op-level SAC — matmul and attention outputs are kept, pointwise ops are recomputed;
- offload: the block's saved tensors (or, under checkpointing, its saved inputs) live in CPU memory.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from flexengine.config import MemoryConfig
from flexengine.errors import UserError
from flexengine.memory.offload import OffloadManager

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks (HF causal LMs keep it at get_decoder().layers)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UserError(f"{type(model).__name__}: cannot find its decoder blocks (expected get_decoder().layers)")
    return layers


def select_layers(spec: str, n_layers: int) -> list[int]:
    """Block indices for memory.layers: all | every_<n> | first_<k> | last_<k> | "0,3,7"."""
    spec = str(spec).strip()
    try:
        if spec == "all":
            return list(range(n_layers))
        if spec.startswith("every_"):
            n = int(spec[len("every_"):])
            return list(range(n - 1, n_layers, n)) if n > 0 else []
        if spec.startswith("first_"):
            return list(range(min(int(spec[len("first_"):]), n_layers)))
        if spec.startswith("last_"):
            k = int(spec[len("last_"):])
            return list(range(max(0, n_layers - k), n_layers))
        if spec in ("", "none"):
            return []
        indices = sorted({int(i) for i in spec.split(",")})
    except ValueError:
        raise UserError(f"memory.layers={spec!r}: use all, every_<n>, first_<k>, last_<k> "
                        "or a list like 0,3,7") from None
    bad = [i for i in indices if not 0 <= i < n_layers]
    if bad:
        raise UserError(f"memory.layers={spec!r}: blocks {bad} do not exist "
                        f"(the model has {n_layers}: 0..{n_layers - 1})")
    return indices


def _saved_ops() -> set:
    """Ops whose outputs op-level SAC keeps: matmuls and fused attention (expensive to recompute, cheap to hold
    relative to the pointwise ops around them)."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    ops.add(torch.ops.higher_order.flex_attention)  # torchtitan #1631: flex must be saved, not recomputed
    return ops


def save_matmuls_and_attention(ctx: Any, func: Any, *args, **kwargs) -> CheckpointPolicy:
    """SAC policy: keep matmul/attention outputs, recompute everything else (norms, RoPE, SiLU, adds)."""
    return CheckpointPolicy.MUST_SAVE if func in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED_OPS = _saved_ops()


def _sac_context():
    return create_selective_checkpoint_contexts(save_matmuls_and_attention)


def wrap_checkpoint(module: nn.Module, context_fn: Optional[Callable] = None) -> None:
    """Recompute `module` in backward: its forward becomes a non-reentrant checkpoint of itself."""
    inner = module.forward
    extra = {"context_fn": context_fn} if context_fn is not None else {}

    def forward(*args, **kwargs):
        # non-reentrant: works with kwargs, compile and activation offload hooks
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward  # instance attribute: parameter names and state_dict keys stay HF's


def _submodule(layer: nn.Module, name: str, granularity: str) -> nn.Module:
    sub = getattr(layer, name, None)
    if not isinstance(sub, nn.Module):
        raise UserError(
            f"memory.granularity={granularity}: {type(layer).__name__} has no `{name}` sub-module; "
            "use memory.granularity=block"
        )
    return sub


def apply_block_policy(layer: nn.Module, granularity: str) -> None:
    """Checkpoint one decoder block at the given granularity (block | attention | mlp | ops)."""
    if granularity == "block":
        wrap_checkpoint(layer)
    elif granularity == "attention":
        wrap_checkpoint(_submodule(layer, "self_attn", granularity))
    elif granularity == "mlp":
        wrap_checkpoint(_submodule(layer, "mlp", granularity))
    elif granularity == "ops":
        wrap_checkpoint(layer, _sac_context)
    else:
        raise UserError(f"memory.granularity={granularity!r}: choose block, attention, mlp or ops")


def apply_memory_policy(model: nn.Module, memory: MemoryConfig) -> list[int]:
    """Apply memory.policy to the selected blocks in place; returns the indices of the blocks it changed."""
    if memory.policy == "none":
        return []
    if memory.policy == "auto":
        raise UserError(
            "memory.policy=auto must be resolved to a concrete policy by the planner first "
            "(flexengine.memory.planner.resolve_auto_memory); run.py does this for training"
        )
    layers = decoder_layers(model)
    chosen = select_layers(memory.layers, len(layers))
    recompute = memory.policy in ("full", "selective")
    offload = memory.policy == "offload" or memory.offload
    manager = OffloadManager() if offload else None
    for i in chosen:
        if recompute:
            apply_block_policy(layers[i], memory.granularity)
        if manager is not None:
            # Hooks go around the block's __call__, outside any compiled region and outside the checkpoint,
            # so under checkpointing only the checkpoint's inputs are offloaded.
            manager.attach(layers[i], i)
    if manager is not None:
        model._flexengine_offload = manager  # keeps one manager (one side stream) per model
    log.info(
        "memory: policy=%s granularity=%s offload=%s on %d of %d blocks %s",
        memory.policy, memory.granularity if recompute else "-", offload, len(chosen), len(layers), chosen,
    )
    return chosen

