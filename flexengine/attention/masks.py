"""Pure mask functions in FlexAttention's `mask_mod` signature, and their composition.

Each function answers "may query `q_idx` attend to key `kv_idx`?" with tensor ops only, so the very same
function feeds `create_block_mask` (flex backend, evaluated per block under vmap) and a dense boolean mask
(reference backend, evaluated by broadcasting index tensors). One source of truth for both backends.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """A query sees itself and every earlier key."""
    return q_idx >= kv_idx


def get_document_mask_mod(document_ids_BS: Tensor) -> MaskMod:
    """A query sees only keys of its own document (document_ids_BS: [B, S] int)."""

    def same_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return document_ids_BS[b, q_idx] == document_ids_BS[b, kv_idx]

    return same_document


def get_sliding_window_mask_mod(window: int) -> MaskMod:
    """A query sees the `window` most recent keys including itself (HF's `sliding_window`: kv > q - window)."""

    def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx - kv_idx < window

    sliding_window.__name__ = f"sliding_window_{window}"
    return sliding_window


def get_mask_mod(document_ids_BS: Optional[Tensor] = None, window: Optional[int] = None) -> MaskMod:
    """Causal, and with document ids per-document, and with a window sliding: the masks composed (attention-gym's
    `generate_doc_mask_mod` idea: "packed X" is X and a document mask, not a new mode)."""
    mods: list[MaskMod] = [causal_mask]
    if document_ids_BS is not None:
        mods.append(get_document_mask_mod(document_ids_BS))
    if window is not None:
        mods.append(get_sliding_window_mask_mod(window))
    composed = and_masks(*mods) if len(mods) > 1 else mods[0]
    composed.__name__ = "_and_".join(m.__name__ for m in mods)
    return composed


def document_ids_from_position_ids(position_ids_BS: Tensor) -> Tensor:
    """Document index of every token: a new document starts wherever the position id restarts at 0."""
    return torch.cumsum((position_ids_BS == 0).to(torch.int32), dim=-1)


def position_ids_from_document_ids(document_ids_BS: Tensor) -> Tensor:
    """Position of every token within its document (RoPE restarts at each document)."""
    S = document_ids_BS.shape[-1]
    idx = torch.arange(S, device=document_ids_BS.device).expand_as(document_ids_BS)
    starts = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    # index of the most recent document start at or before each token
    start_idx = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - start_idx
