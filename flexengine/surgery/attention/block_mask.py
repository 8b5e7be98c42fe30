"""Build the per-batch attention mask once (BlockMask for flex, dense chunks, varlen ids) for all layers.

Every form comes from the layer's `MaskMode` (attention/mask_mode.py); this module only packs them into what
each backend consumes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, TypedDict

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from flexengine.surgery.attention.mask_mode import MaskMode, band_mode, canonical_document_ids
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.attention.varlen import plan_calls


@dataclass
class DenseChunk:
    """Queries [q_start, q_end) attend keys [kv_start, kv_end) under `mask_B1QK` (True = allowed)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    mask_B1QK: Tensor


@dataclass
class BatchMask:
    """Everything the attention layers of one forward share, in the form one backend runs: a `FlexMask`,
    `DenseMask` or `VarlenMask`. The attention function picks its kernel by the mask's type, and each type holds
    only its own form, so no field is None for a backend that does not use it."""

    mode: MaskMode  # the mask every form was derived from
    computed_blocks: Tensor  # 0-d tensor: attention blocks the mask touches (no host sync)
    causal_blocks: float  # blocks a plain causal mask of the same shape would touch (a share of them under CP)
    block_size: int

    @property
    def executed_pairs(self):
        """(query, key) pairs the backend computes per layer and head, summed over rows: here, whole blocks (a 0-d
        tensor: no host sync); the dense backend counts its chunks instead."""
        return self.computed_blocks * self.block_size**2

    @property
    def block_density(self) -> Tensor:
        """Fraction of a causal mask's blocks actually computed (1.0 = no saving; FlexAttention calls 1 minus
        the fraction of all blocks computed its sparsity); call .item() when logging."""
        return self.computed_blocks / self.causal_blocks


@dataclass
class FlexMask(BatchMask):
    """attn.backend=flex: FlexAttention's block structure."""

    block_mask: BlockMask  # [B, 1, S/block, S/block]


@dataclass
class DenseMask(BatchMask):
    """attn.backend=dense: one SDPA call per query chunk, over only the keys that chunk may see."""

    dense_chunks: list[DenseChunk]  # query chunks covering the row, in order

    @property
    def executed_pairs(self) -> int:
        """Each chunk's query x key rectangle, summed (an int)."""
        return sum(c.mask_B1QK.shape[0] * (c.q_end - c.q_start) * (c.kv_end - c.kv_start) for c in self.dense_chunks)


@dataclass
class VarlenMask(BatchMask):
    """attn.backend=varlen: ids whose runs are the documents (attention/varlen.py), its calls planned on the host."""

    varlen_ids: Tensor  # [B, S]


class _CommonFields(TypedDict):
    """The BatchMask fields every backend's mask of one batch has alike (`computed_blocks` differs)."""

    mode: MaskMode
    causal_blocks: float
    block_size: int


@functools.cache
def _compiled_create_block_mask():
    return torch.compile(create_block_mask, dynamic=False)  # once per process


def _create_block_mask(mask_mod, B: int, S: int, device: torch.device, block_size: int) -> BlockMask:
    # torch's element-wise builder, O(S^2) per row: kept as the reference the tests compare the block-level one
    # with. On CUDA a compiled builder avoids materialising [S, S] per row (pytorch #151043); on CPU compiling it
    # costs ~27 s, more than the eager build of any CPU-sized run saves.
    build = _compiled_create_block_mask() if device.type == "cuda" else create_block_mask
    return build(mask_mod, B, None, S, S, device=device, BLOCK_SIZE=block_size)


def _ordered_blocks(blocks_BQK: Tensor) -> tuple[Tensor, Tensor]:
    """Block occupancy [B, nq, nk] -> (count [B, 1, nq], indices [B, 1, nq, nk] with the used blocks first)."""
    num = blocks_BQK.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks_BQK.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None], indices[:, None]


def build_block_mask(mode: MaskMode, document_ids_BS: Tensor, block_size: int) -> BlockMask:
    """The flex BlockMask from the mode's block occupancy: O((S/block)^2) per row, no [S, S]. Blocks that may
    attend but not entirely are "partial": the mode's mask_mod decides per element inside them, so the result is
    exact wherever the occupancy is conservative. document_ids_BS: canonical (`canonical_document_ids`)."""
    S = document_ids_BS.shape[1]
    some, every = mode.block_occupancy(document_ids_BS, block_size)
    kv_num, kv_idx = _ordered_blocks(some & ~every)
    full_num, full_idx = _ordered_blocks(every)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mode.mask_mod(document_ids_BS),
        seq_lengths=(S, S),
    )


def _causal_block_count(B: int, S: int, block_size: int) -> int:
    n = -(-S // block_size)
    return B * n * (n + 1) // 2


def build_batch_mask(
    document_ids_BS: Tensor,
    *,
    backend: AttnBackend,
    mode: Optional[MaskMode] = None,
    documents: bool = False,
    window: Optional[int] = None,
    block_size: int = 128,
    dense_chunk: int = 512,
) -> BatchMask:
    """The mask of `mode` for one batch of rows [B, S], in the form `backend` runs.

    mode: the layer's MaskMode (else causal, per document if `documents`, within `window` if given).
    dense_chunk: queries per SDPA call of the dense backend (its keys span only what the chunk may see).
    """
    mode = mode or band_mode(documents, window)
    B, S = document_ids_BS.shape
    document_ids_BS = canonical_document_ids(document_ids_BS)
    common = _CommonFields(mode=mode, causal_blocks=_causal_block_count(B, S, block_size), block_size=block_size)
    if backend is AttnBackend.FLEX:
        block_mask = build_block_mask(mode, document_ids_BS, block_size)
        computed = block_mask.kv_num_blocks.sum()
        if block_mask.full_kv_num_blocks is not None:
            computed = computed + block_mask.full_kv_num_blocks.sum()
        return FlexMask(**common, computed_blocks=computed, block_mask=block_mask)
    if backend not in (AttnBackend.VARLEN, AttnBackend.DENSE):
        raise ValueError(f"unknown mask backend {backend!r}")
    # these visit no blocks: the density metric counts what a block-sparse kernel would compute
    computed = mode.block_occupancy(document_ids_BS, block_size)[0].sum()
    if backend is AttnBackend.VARLEN:
        ids = mode.row_ids(document_ids_BS)
        plan_calls(ids, mode.varlen_window)  # planned now, on the host, once per batch (every layer finds it)
        return VarlenMask(**common, computed_blocks=computed, varlen_ids=ids)
    return DenseMask(**common, computed_blocks=computed, dense_chunks=_dense_chunks(mode, document_ids_BS, dense_chunk))


def _dense_chunks(mode: MaskMode, document_ids_BS: Tensor, chunk: int) -> list[DenseChunk]:
    # Keys no query of a chunk may see (before its earliest document start or window, after its last query) are
    # skipped, not masked: dense cost follows the documents, not S^2. Exact either way: the mask still decides
    # inside the kept range. Reading the ranges costs one host sync per batch (CPU backend).
    B, S = document_ids_BS.shape
    mask_mod = mode.mask_mod(document_ids_BS)
    chunks = []
    for q_start, kv_start, kv_end in mode.key_ranges(document_ids_BS, chunk):
        q_end = min(q_start + chunk, S)
        mask = dense_mask_from_mod(mask_mod, B, range(q_start, q_end), range(kv_start, kv_end), document_ids_BS.device)
        chunks.append(DenseChunk(q_start, q_end, kv_start, kv_end, mask))
    return chunks


def dense_mask_from_mod(mask_mod, B: int, q_range: range, kv_range: range, device: torch.device) -> Tensor:
    """Evaluate a mask_mod on every (q, kv) pair of the ranges by broadcasting: [B, 1, len(q), len(kv)] bool."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_range.start, q_range.stop, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_range.start, kv_range.stop, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(B, 1, len(q_range), len(kv_range))


__all__ = [
    "BatchMask",
    "DenseChunk",
    "DenseMask",
    "FlexMask",
    "VarlenMask",
    "build_batch_mask",
    "build_block_mask",
    "canonical_document_ids",
]
