"""Op-level selective activation checkpointing's policy: which ops' outputs a SAC checkpoint keeps (memory/kinds.py's
`OpLevel` runs its checkpoints under `sac_context`)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from flexengine.surgery.attention import varlen


def _saved_ops() -> set[Callable[..., Any]]:
    """Ops whose outputs op-level SAC keeps: matmuls and fused attention (expensive to recompute, cheap to hold
    relative to the pointwise ops around them)."""
    aten = torch.ops.aten
    ops: set[Callable[..., Any]] = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    ops.add(torch.ops.higher_order.flex_attention)  # torchtitan #1631: flex must be saved, not recomputed
    # CPU's per-document attention is one custom op: saved too, or SAC re-runs every document's attention in
    # backward (measured: op-level SAC then cost more than recomputing whole blocks, bench/planner_time.py)
    ops.add(varlen.varlen_attention_op())
    return ops


def save_matmuls_and_attention(ctx: Any, func: Any, *args, **kwargs) -> CheckpointPolicy:
    """SAC policy: keep matmul/attention outputs, recompute everything else (norms, RoPE, SiLU, adds)."""
    return CheckpointPolicy.MUST_SAVE if func in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED_OPS = _saved_ops()


def sac_context():
    """The context pair op-level SAC checkpoints run under (memory/kinds.py's OpLevel)."""
    return create_selective_checkpoint_contexts(save_matmuls_and_attention)
