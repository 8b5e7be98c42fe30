"""The batch's target contract: which positions carry a next-token target. The loader computes them once per
batch on the host; the loss, context parallelism and the metrics read them (IGNORE_INDEX marks "no target")."""

from __future__ import annotations

import torch
from torch import Tensor

from flexengine.data.packing import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "batch_valid_targets", "count_valid_targets", "predicting_positions", "shift_targets"]


def count_valid_targets(labels_BS: Tensor) -> Tensor:
    """Tokens that have a next-token target (labels shifted by one, -100 excluded)."""
    return (labels_BS[:, 1:] != IGNORE_INDEX).sum()


def shift_targets(labels_BS: Tensor) -> Tensor:
    """Each position's next-token target ([B, S], -100 where none): labels shifted left by one, so that a row
    cut into pieces (context parallelism) keeps every target next to the token that predicts it."""
    targets = torch.full_like(labels_BS, IGNORE_INDEX)
    targets[:, :-1] = labels_BS[:, 1:]
    return targets


def batch_valid_targets(batch: dict[str, Tensor]) -> Tensor:
    """Valid next-token targets of a batch: full rows (`labels`) or a context-parallel shard (`targets`)."""
    if "targets" in batch:
        return (batch["targets"] != IGNORE_INDEX).sum()
    return count_valid_targets(batch["labels"])


def predicting_positions(labels_BS: Tensor) -> Tensor:
    """Flat [B*S] indices of the tokens whose next token is a valid target (computed once per batch, on the
    host by the loader, so selecting them costs no device sync)."""
    return torch.nonzero(shift_targets(labels_BS).reshape(-1) != IGNORE_INDEX).squeeze(1)
