"""Attention rewrite: the resolved spec, mask functions, per-batch masks, and the patch that routes HF attention."""

from flexengine.surgery.attention.block_mask import BatchMask, build_batch_mask
from flexengine.surgery.attention.mask_mode import MaskMode, get_mask_mod, mask_mode
from flexengine.surgery.attention.masks import (
    Causal,
    InnerMask,
    SlidingWindow,
    document_ids_from_position_ids,
    position_ids_from_document_ids,
)
from flexengine.surgery.attention.patch import MASK_KWARG, LayerMasks, apply_attention, mask_kwargs, patch_attention
from flexengine.surgery.attention.spec import AttentionSpec, AttnBackend, resolve_attention_spec, resolve_backend

__all__ = [
    "MASK_KWARG",
    "AttentionSpec",
    "AttnBackend",
    "BatchMask",
    "Causal",
    "InnerMask",
    "LayerMasks",
    "MaskMode",
    "SlidingWindow",
    "apply_attention",
    "build_batch_mask",
    "document_ids_from_position_ids",
    "get_mask_mod",
    "mask_kwargs",
    "mask_mode",
    "patch_attention",
    "position_ids_from_document_ids",
    "resolve_attention_spec",
    "resolve_backend",
]
