"""Build the per-batch attention mask once (BlockMask for flex, dense bool for the reference) for all layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from flexengine.attention.masks import get_mask_mod


@dataclass
class BatchMask:
    """Everything the attention layers of one forward share. Exactly one of the two masks is set."""

    mode: str
    backend: str  # "flex" or "dense"
    block_mask: Optional[BlockMask] = None  # flex: [B, 1, S/block, S/block] block structure
    dense_mask_B1SS: Optional[Tensor] = None  # dense: True where attention is allowed
    computed_blocks: Optional[Tensor] = None  # 0-d tensor: attention blocks the mask touches (no host sync)
    causal_blocks: int = 0  # blocks a plain causal mask of the same shape would touch

    @property
    def block_sparsity(self) -> Tensor:
        """Fraction of a causal mask's blocks actually computed (1.0 = no saving); call .item() when logging."""
        return self.computed_blocks / self.causal_blocks


_compiled_create_block_mask = None


def _create_block_mask(mask_mod, B: int, S: int, device: torch.device, block_size: int) -> BlockMask:
    # On CUDA a compiled builder avoids materialising [S, S] per row (mask building can cost more than attention,
    # pytorch #151043); on CPU compiling it costs ~27 s, more than the eager build of any CPU-sized run saves.
    global _compiled_create_block_mask
    if device.type == "cuda":
        if _compiled_create_block_mask is None:
            _compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)
        build = _compiled_create_block_mask
    else:
        build = create_block_mask
    return build(mask_mod, B, None, S, S, device=device, BLOCK_SIZE=block_size)


def _causal_block_count(B: int, S: int, block_size: int) -> int:
    n = -(-S // block_size)
    return B * n * (n + 1) // 2


def build_batch_mask(
    mode: str,
    backend: str,
    document_ids_BS: Tensor,
    window: Optional[int] = None,
    block_size: int = 128,
) -> BatchMask:
    """The mask for one batch of rows [B, S] under an attention mode, for the flex or dense backend."""
    B, S = document_ids_BS.shape
    device = document_ids_BS.device
    mask_mod = get_mask_mod(mode, document_ids_BS, window)
    causal_blocks = _causal_block_count(B, S, block_size)
    if backend == "flex":
        block_mask = _create_block_mask(mask_mod, B, S, device, block_size)
        computed = block_mask.kv_num_blocks.sum()
        if block_mask.full_kv_num_blocks is not None:
            computed = computed + block_mask.full_kv_num_blocks.sum()
        return BatchMask(mode, backend, block_mask=block_mask, computed_blocks=computed, causal_blocks=causal_blocks)
    if backend == "dense":
        dense = dense_mask_from_mod(mask_mod, B, S, device)
        return BatchMask(
            mode, backend, dense_mask_B1SS=dense, computed_blocks=_count_blocks(dense, block_size),
            causal_blocks=causal_blocks,
        )
    raise ValueError(f"unknown mask backend {backend!r}")


def dense_mask_from_mod(mask_mod, B: int, S: int, device: torch.device) -> Tensor:
    """Evaluate a mask_mod on every (q, kv) pair by broadcasting: [B, 1, S, S] bool."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(S, device=device).view(1, 1, S, 1)
    kv = torch.arange(S, device=device).view(1, 1, 1, S)
    return mask_mod(b, h, q, kv).expand(B, 1, S, S)


def _count_blocks(dense_B1SS: Tensor, block_size: int) -> Tensor:
    B, _, S, _ = dense_B1SS.shape
    n = -(-S // block_size)
    pad = n * block_size - S
    padded = torch.nn.functional.pad(dense_B1SS[:, 0], (0, pad, 0, pad))
    return padded.view(B, n, block_size, n, block_size).any(dim=4).any(dim=2).sum()
