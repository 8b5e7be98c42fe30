"""Op-level SAC's policy (flexengine/surgery/memory/sac.py): matmuls and attention are kept, everything else is
recomputed -- checked on which ops a checkpoint's backward re-runs, counted by a dispatch mode."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from flexengine.surgery.memory.sac import sac_context, save_matmuls_and_attention


class _Ops(TorchDispatchMode):
    """How many times each op runs."""

    def __init__(self):
        super().__init__()
        self.count: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _block(x, w):
    return torch.sin(x @ w) @ w  # two matmuls, one pointwise op between them


def _backward_ops(**checkpoint_kwargs) -> Counter:
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    out = checkpoint(_block, x, w, use_reentrant=False, **checkpoint_kwargs) if checkpoint_kwargs else _block(x, w)
    with _Ops() as ops:
        out.sum().backward()
    return ops.count


def test_sac_recomputes_the_pointwise_op_and_keeps_the_matmuls():
    plain = _backward_ops()
    whole = _backward_ops(determinism_check="default")  # a plain checkpoint: re-runs the whole forward
    sac = _backward_ops(context_fn=sac_context)
    # backward of two matmuls: two mm each (input and weight gradients). A whole checkpoint re-runs x @ w once more,
    # and stops there: the last matmul's output is read by no backward (non-reentrant checkpointing stops early)
    assert plain["mm"] == 4 and whole["mm"] == 5 and whole["sin"] == 1
    assert sac["mm"] == 4  # SAC kept the forward matmuls' outputs: nothing to re-run there
    assert plain["sin"] == 0 and sac["sin"] == 1  # ...but sin's output was not kept: re-run once


@pytest.mark.parametrize(
    ("op", "policy"),
    [
        (torch.ops.aten.mm.default, CheckpointPolicy.MUST_SAVE),
        (torch.ops.aten.addmm.default, CheckpointPolicy.MUST_SAVE),
        (torch.ops.aten.bmm.default, CheckpointPolicy.MUST_SAVE),
        (torch.ops.higher_order.flex_attention, CheckpointPolicy.MUST_SAVE),  # flex must be saved, not re-run
        (torch.ops.aten.add.Tensor, CheckpointPolicy.PREFER_RECOMPUTE),
        (torch.ops.aten.mul.Tensor, CheckpointPolicy.PREFER_RECOMPUTE),
        (torch.ops.aten.silu.default, CheckpointPolicy.PREFER_RECOMPUTE),
        (torch.ops.aten.rsqrt.default, CheckpointPolicy.PREFER_RECOMPUTE),
    ],
)
def test_policy_saves_matmuls_and_attention_and_recomputes_the_rest(op, policy):
    assert save_matmuls_and_attention(None, op) is policy
