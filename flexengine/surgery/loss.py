"""Cross-entropy summed over valid tokens, optionally in chunks so [tokens, vocab] logits never exist at once.

The trainer divides the sum by the number of valid tokens of the whole accumulation window (and across ranks),
so packing, padding and micro-batching do not change the loss (axolotl #3301, TRL #3910).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from flexengine.data.targets import IGNORE_INDEX, predicting_positions
from flexengine.surgery.family import hf_causal_lm
from flexengine.surgery.fused_loss import check_fusable_head, fused_linear_cross_entropy_sum


def _chunk_loss_sum(hidden_NH: Tensor, targets_N: Tensor, lm_head: nn.Module) -> Tensor:
    logits = lm_head(hidden_NH).float()  # CE in fp32 even under bf16
    return F.cross_entropy(logits, targets_N, reduction="sum")


def causal_lm_loss_sum(
    hidden_BSH: Tensor,
    labels_BS: Tensor,
    lm_head: nn.Module,
    chunk_size: int = 0,
    predicting_index: Optional[Tensor] = None,
    fused: bool = False,
) -> Tensor:
    """Sum of next-token CE over valid targets. chunk_size > 0: lm_head + CE per chunk of tokens, each chunk
    recomputed in backward, so peak memory holds one chunk's logits instead of all of them; fused (chunk_size > 0):
    each chunk's gradients computed in the forward instead (surgery/fused_loss.py), so nothing is recomputed.
    predicting_index: `predicting_positions(labels_BS)` if already known (else computed here: a host sync)."""
    if predicting_index is None:
        predicting_index = predicting_positions(labels_BS)
    targets_N = labels_BS.reshape(-1).index_select(0, predicting_index + 1)
    return _selected_loss_sum(hidden_BSH, predicting_index, targets_N, lm_head, chunk_size, fused)


def shifted_loss_sum(
    hidden_BSH: Tensor,
    targets_BS: Tensor,
    lm_head: nn.Module,
    chunk_size: int = 0,
    predicting_index: Optional[Tensor] = None,
    fused: bool = False,
) -> Tensor:
    """causal_lm_loss_sum with the targets already shifted (`shift_targets`): position t predicts targets[t]."""
    if predicting_index is None:
        predicting_index = torch.nonzero(targets_BS.reshape(-1) != IGNORE_INDEX).squeeze(1)
    targets_N = targets_BS.reshape(-1).index_select(0, predicting_index)
    return _selected_loss_sum(hidden_BSH, predicting_index, targets_N, lm_head, chunk_size, fused)


def _selected_loss_sum(
    hidden_BSH: Tensor,
    predicting_index: Tensor,
    targets_N: Tensor,
    lm_head: nn.Module,
    chunk_size: int,
    fused: bool = False,
) -> Tensor:
    # only tokens with a valid next target: padding and document ends cost no lm_head or CE at all
    hidden_NH = hidden_BSH.reshape(-1, hidden_BSH.shape[-1]).index_select(0, predicting_index)
    if chunk_size <= 0 or hidden_NH.shape[0] <= chunk_size:  # one piece: nothing to re-run, fused or not
        return _chunk_loss_sum(hidden_NH, targets_N, lm_head)
    if fused:
        return fused_linear_cross_entropy_sum(hidden_NH, targets_N, check_fusable_head(lm_head), chunk_size)
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden_NH.shape[0], chunk_size):
        end = start + chunk_size
        total = total + checkpoint(
            _chunk_loss_sum, hidden_NH[start:end], targets_N[start:end], lm_head, use_reentrant=False
        )
    return total


def forward_loss_sum(
    model: nn.Module, batch: dict[str, Tensor], chunk_size: int = 0, fused: bool = False, **mask_kwargs
) -> Tensor:
    """Run the decoder on a batch and return the summed token loss (no logits tensor for the whole batch);
    chunk_size, fused: loss.chunk_size, loss.fused."""
    lm = hf_causal_lm(model)
    decoder = lm.get_decoder()
    out = decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **mask_kwargs)
    shifted = "targets" in batch  # a context-parallel shard: this rank's tokens, each with its own target
    loss_sum = shifted_loss_sum if shifted else causal_lm_loss_sum
    return loss_sum(
        out.last_hidden_state,
        batch["targets" if shifted else "labels"],
        lm.get_output_embeddings(),
        chunk_size,
        batch.get("predicting_index"),
        fused,
    )
