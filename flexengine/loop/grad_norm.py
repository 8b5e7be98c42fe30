"""The gradients' global L2 norm, in fp32 whatever dtype the gradients are stored in.

torch's `get_total_norm` (and so `clip_grad_norm_`) returns the norm in the gradients' dtype: each tensor's norm is
rounded to bf16, then their combination, and the clip coefficient max_norm / (norm + eps) is derived in bf16 too.
Under bf16 gradients (precision=bf16_sr, bf16_cpu_master, bf16_pure) that logged 2.828125 where fp32 gives 2.8323.
Here each tensor's norm is reduced straight into fp32 (`_foreach_norm(dtype=float32)`: on CUDA the kernel reads
bf16 and accumulates in fp32; on CPU it upcasts one tensor at a time), so no fp32 copy of all the gradients
(27 GB at 7B) ever exists. Gradients that are DTensors (FSDP2) give a DTensor norm, as torch's does.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `grads` taken as one vector, as an fp32 scalar on the first gradient's device."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    first = grads[0].device
    norms = [n.to(first) for group in by_device.values() for n in torch._foreach_norm(group, 2.0, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms))


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ with the norm (and so the coefficient) in fp32: scales the gradients in place so that their
    total norm is at most max_norm (inf: leaves them alone); returns the norm before clipping."""
    params = list(params)
    norm = total_norm([p.grad for p in params if p.grad is not None])
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
