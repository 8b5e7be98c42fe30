"""Context parallelism (`parallel.cp=N`) with torch's own implementation: each row's tokens split over N ranks.

torch 2.13's experimental context parallel (torch.distributed.tensor.experimental._context_parallel), flex path:
- `_ContextParallel(seq_dim=2, FLEX)` on a module whose forward is flex_attention: its forward pre-hook
  all-gathers K and V along the sequence (`flex_cp_allgather`; its backward reduce-scatters their gradients),
  so each rank's queries attend to the whole row.
- `_context_parallel_shard(mesh, buffers, seq_dims, load_balancer)`: reorders, then shards the batch tensors,
  and rebuilds each BlockMask for this rank's queries against the whole reordered row.
- `_PTRRLoadBalancer(block_mask, N)`: reorders 128-token query blocks so that every rank gets the same number of
  attended blocks -- equal work, not just equal tokens (in a packed row, blocks late in a long document attend
  to many more keys than blocks of short documents).

The torchrun world is a 2-D DeviceMesh ("dp", "cp"): ranks r and r' with r // N == r' // N read the same rows
and each keeps its 1/N of them; FSDP2 shards weights over the flattened mesh (all ranks; torchtitan's
"dp_shard_cp"). Each rank's loss is the CE sum over its own targets (shifted before the split, so a target
never sits on another rank), divided by the valid targets of all ranks; gradients are summed over all ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, cast

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flexengine.core.distributed import DistInfo
from flexengine.core.errors import UserError
from flexengine.data.packing import IGNORE_INDEX
from flexengine.data.targets import shift_targets
from flexengine.surgery.applied import attention_spec
from flexengine.surgery.attention.block_mask import FlexMask, canonical_document_ids
from flexengine.surgery.attention.masks import document_ids_from_position_ids
from flexengine.surgery.attention.patch import CP_ATTENTION, MASK_KWARG, LayerMasks, _flex_fn, mask_kwargs
from flexengine.surgery.family import family_of

log = logging.getLogger(__name__)


class FlexAttentionCall(nn.Module):
    """flex_attention as a module (no parameters): torch's `_ContextParallel` hooks a module's forward."""

    def __init__(self, flex: Callable):
        super().__init__()
        self.flex = flex

    def forward(self, query: Tensor, key: Tensor, value: Tensor, **kwargs) -> Tensor:
        """q [B, Hq, S/N, D]; k/v [B, Hkv, S, D] once the pre-hook gathered them -> out [B, Hq, S/N, D]."""
        return self.flex(query, key, value, **kwargs)


@dataclasses.dataclass
class ContextParallel:
    """The (dp, cp) mesh of a context-parallel job, and the per-batch split of rows over its cp ranks."""

    mesh: DeviceMesh  # 2-D: ("dp", "cp")
    fsdp_mesh: DeviceMesh  # all ranks as one dimension, "dp_cp": FSDP2 shards weights over dp x cp (every
    # rank computes gradients of the same weights: its queries, the whole row's keys)

    @property
    def degree(self) -> int:
        """Ranks sharing one row (parallel.cp)."""
        return self.mesh["cp"].size()

    def apply(self, model: nn.Module) -> None:
        """Give every attention module a flex call with torch's K/V all-gather hook (patched flex attention)."""
        from torch.distributed.tensor.experimental._context_parallel import _ContextParallel
        from torch.distributed.tensor.parallel import parallelize_module

        spec = attention_spec(model)
        if spec is None:
            raise UserError("parallel.cp: apply_attention (attn.backend=flex) must come before context parallelism")
        style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
        family = family_of(model)
        for i, layer in enumerate(family.decoder_layers(model)):
            attention = getattr(layer, family.attention.module, None)
            if attention is None:
                raise UserError(
                    f"parallel.cp: decoder block {i} of {type(model).__name__} has no {family.attention.module} module"
                )
            call = parallelize_module(FlexAttentionCall(_flex_fn(spec.compile)), self.mesh["cp"], style)
            setattr(attention, CP_ATTENTION, call)
        log.info(
            "context parallel: rows split over %d ranks (%d data-parallel groups), K/V all-gathered per "
            "block, PTRR load balancing",
            self.degree,
            self.mesh["dp"].size(),
        )

    def shard(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict]:
        """Full rows of one micro-batch -> (this rank's load-balanced share, its mask kwargs for the model).

        The share holds input_ids, position_ids (they restart per document: RoPE sees the true positions), the
        shifted `targets` and each token's place in the row (`token_index`), all reordered and cut the same
        way; the masks are torch's CP BlockMasks (this
        rank's queries against the whole row), one per distinct window of the model."""
        from torch.distributed.tensor.experimental._context_parallel import (
            _context_parallel_shard,
            _PTRRLoadBalancer,
        )

        document_ids = canonical_document_ids(batch["document_ids"])
        masks: LayerMasks = mask_kwargs(model, document_ids)[MASK_KWARG]
        distinct = {id(m): m for m in masks.by_hf_window.values()}  # layers of one window share a mask
        # one reordering for the whole model: balanced on the full-attention mask (windowed layers follow it)
        balanced_on = masks.by_hf_window.get(None, next(iter(distinct.values())))
        balancer = _PTRRLoadBalancer(balanced_on.block_mask, self.degree)
        B, S = batch["input_ids"].shape
        token_index = torch.arange(S, device=batch["input_ids"].device).expand(B, S)
        tensors = [batch["input_ids"], batch["position_ids"], shift_targets(batch["labels"]), token_index]
        block_masks = [m.block_mask for m in distinct.values()]
        shards = _context_parallel_shard(
            self.mesh["cp"], [*tensors, *block_masks], [1] * (len(tensors) + len(block_masks)), load_balancer=balancer
        )
        # torch returns each buffer as the type it was given: the tensors first, then the BlockMasks
        input_ids, position_ids, targets, token_index = (cast(Tensor, t) for t in shards[: len(tensors)])
        local = {
            key: _local_mask(m, cp_mask, self.degree)
            for (key, m), cp_mask in zip(distinct.items(), shards[len(tensors) :])
        }
        by_hf = {w: local[id(m)] for w, m in masks.by_hf_window.items()}
        # one host sync per micro-batch (the loader's host-side index is of the unsplit row)
        predicting = torch.nonzero(targets.reshape(-1) != IGNORE_INDEX).squeeze(1)
        share = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "targets": targets,
            "predicting_index": predicting,
            "token_index": token_index,
        }  # token_index: place in the row
        return share, {MASK_KWARG: LayerMasks(masks.spec, by_hf)}

    def whole_rows(self, share: Tensor, token_index: Tensor) -> Tensor:
        """This rank's [B, S/cp, ...] per-token tensor -> the whole rows [B, S, ...], on every cp rank (no grad)."""
        group = self.mesh["cp"].get_group()
        parts = [torch.empty_like(share) for _ in range(self.degree)]
        places = [torch.empty_like(token_index) for _ in range(self.degree)]
        torch.distributed.all_gather(parts, share.contiguous(), group=group)
        torch.distributed.all_gather(places, token_index.contiguous(), group=group)
        B, S = token_index.shape[0], token_index.shape[1] * self.degree
        rows = share.new_empty(B, S, *share.shape[2:])
        for part, place in zip(parts, places):
            rows.scatter_(1, place.view(*place.shape, *([1] * (share.dim() - 2))).expand_as(part), part)
        return rows

    @torch.no_grad()
    def logits(self, root: nn.Module, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """Whole-row logits [B, S, vocab] of input_ids/position_ids (S a multiple of cp x 128), computed split over
        the cp ranks through the root module (`LossForward(logits=True)`), e.g. for greedy samples."""
        full = {
            **batch,
            "labels": batch.get("labels", batch["input_ids"]),  # targets unused: logits only
            "document_ids": batch.get("document_ids", document_ids_from_position_ids(batch["position_ids"])),
        }
        share, mask_kwargs = self.shard(model, full)
        return self.whole_rows(root(share, logits=True, **mask_kwargs), share["token_index"])


def _local_mask(mask: FlexMask, cp_block_mask, degree: int) -> FlexMask:
    computed = cp_block_mask.kv_num_blocks.sum()
    if cp_block_mask.full_kv_num_blocks is not None:
        computed = computed + cp_block_mask.full_kv_num_blocks.sum()
    # density stays "blocks computed / a causal row's blocks", now for this rank's share of both
    return dataclasses.replace(
        mask, block_mask=cp_block_mask, computed_blocks=computed, causal_blocks=mask.causal_blocks / degree
    )


def build_context_parallel(info: DistInfo, device: torch.device) -> Optional[ContextParallel]:
    """The (dp, cp) mesh when parallel.cp > 1 (every rank calls it after init_distributed); None otherwise."""
    if info.cp == 1:
        return None
    mesh = init_device_mesh(device.type, (info.world_size // info.cp, info.cp), mesh_dim_names=("dp", "cp"))
    return ContextParallel(mesh, mesh["dp", "cp"]._flatten("dp_cp"))
