"""Attention rewrite: mask functions, per-batch masks, and the patch that routes HF attention through them."""

from flexengine.attention.block_mask import BatchMask, build_batch_mask
from flexengine.attention.masks import (
    document_ids_from_position_ids,
    get_mask_mod,
    position_ids_from_document_ids,
)
from flexengine.attention.patch import MASK_KWARG, mask_kwargs, patch_attention, resolve_backend

__all__ = [
    "MASK_KWARG",
    "BatchMask",
    "build_batch_mask",
    "document_ids_from_position_ids",
    "get_mask_mod",
    "mask_kwargs",
    "patch_attention",
    "position_ids_from_document_ids",
    "resolve_backend",
]
