"""NaN/Inf in weights and optimizer states: found cheaply before a checkpoint is written (nothing non-finite is ever
saved or resumed), and told with the optim.* setting most likely to blame.

One max-abs reduction per device (torch._foreach_norm with ord=inf: a NaN or an Inf survives the max, a large
finite value cannot overflow it as a 2-norm could) and one host sync, at save time only: the step loop's own
finite check (loss and grad norm) stays the one sync per step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

from flexengine.core.config import OptimConfig
from flexengine.surgery.parallel import local_shard

NAMES_SHOWN = 3


def nonfinite_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an Inf (plain tensors only: quantized optimizer-state
    subclasses carry their own scales and are skipped)."""
    by_device: dict = defaultdict(list)
    for name, t in named_tensors:
        t = local_shard(t)  # each rank checks its own shard
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_floating_point() or t.numel() == 0:
            continue
        by_device[t.device].append((name, t.detach()))
    bad = []
    for entries in by_device.values():
        maxima = torch._foreach_norm([t for _, t in entries], float("inf"))
        finite = torch.stack([m.float() for m in maxima]).isfinite().tolist()  # the one host sync per device
        bad += [name for (name, _), ok in zip(entries, finite) if not ok]
    return bad


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every optimizer-state tensor; names: id(param) -> parameter name."""
    out = []
    for i, (param, state) in enumerate(optimizer.state.items()):
        owner = names.get(id(param), f"#{i}")
        out += [(f"optimizer {key} of {owner}", v) for key, v in state.items() if isinstance(v, torch.Tensor)]
    return out


def suspect_settings(optim: OptimConfig) -> str:
    """Which optim.* values look likely to have made an update non-finite (or that none does)."""
    suspects = []
    if optim.lr >= 1e-2:
        suspects.append(f"optim.lr={optim.lr:g} is high for fine-tuning (try 1e-4 or lower)")
    if optim.grad_clip == 0:
        suspects.append("optim.grad_clip=0 turns clipping off (one large gradient can blow the weights up; try 1.0)")
    if optim.eps < 1e-10:
        suspects.append(f"optim.eps={optim.eps:g} is tiny: Adam divides by sqrt(v) + eps (try 1e-8)")
    if optim.lr * optim.weight_decay >= 1:
        suspects.append(f"optim.lr x optim.weight_decay = {optim.lr * optim.weight_decay:g} >= 1 flips the weights")
    if suspects:
        return "; ".join(suspects)
    return (
        f"no optim.* value looks out of range (lr {optim.lr:g}, grad_clip {optim.grad_clip:g}, eps {optim.eps:g}, "
        f"weight_decay {optim.weight_decay:g}): check the data for extreme or broken rows, or use a more exact "
        "precision.mode"
    )


def nonfinite_message(step: int, bad: list[str], optim: OptimConfig) -> str:
    """The refusal to save step `step` whose tensors `bad` hold NaN/Inf (empty: another rank's do)."""
    where = (
        f"{len(bad)} tensor(s) hold NaN/Inf ({', '.join(bad[:NAMES_SHOWN])}{', ...' if len(bad) > NAMES_SHOWN else ''})"
        if bad
        else "another rank's weights or optimizer states hold NaN/Inf"
    )
    return (
        f"step {step}: {where}, so its checkpoint was not written (the previous one is intact; train.resume=auto "
        f"continues from it). The last update made them non-finite; likely cause: {suspect_settings(optim)}."
    )
