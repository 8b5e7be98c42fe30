"""Build the per-batch attention mask once (BlockMask for flex, dense bool for the reference) for all layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from flexengine.attention.masks import get_mask_mod, position_ids_from_document_ids
from flexengine.attention.spec import AttnBackend
from flexengine.attention.varlen import plan_calls


@dataclass
class DenseChunk:
    """Queries [q_start, q_end) attend keys [kv_start, q_end) under `mask_B1QK` (True = allowed)."""

    q_start: int
    q_end: int
    kv_start: int
    mask_B1QK: Tensor


@dataclass
class BatchMask:
    """Everything the attention layers of one forward share: a BlockMask (flex) or dense chunks (dense)."""

    documents: bool  # per-document mask (packed rows)
    window: Optional[int]  # sliding window in tokens, None = none
    backend: AttnBackend  # FLEX, DENSE or VARLEN
    block_mask: Optional[BlockMask] = None  # flex: [B, 1, S/block, S/block] block structure
    dense_chunks: Optional[list[DenseChunk]] = None  # dense: query chunks covering the row, in order
    varlen_ids: Optional[Tensor] = None  # varlen: [B, S] ids whose runs are the documents (attention/varlen.py)
    computed_blocks: Optional[Tensor] = None  # 0-d tensor: attention blocks the mask touches (no host sync)
    causal_blocks: int = 0  # blocks a plain causal mask of the same shape would touch
    block_size: int = 128

    @property
    def executed_pairs(self):
        """(query, key) pairs the backend computes per layer and head, summed over rows: flex runs whole
        blocks (a 0-d tensor: no host sync), the dense backend each chunk's query x key rectangle (an int)."""
        if self.dense_chunks is not None:
            return sum(c.mask_B1QK.shape[0] * (c.q_end - c.q_start) * (c.q_end - c.kv_start) for c in self.dense_chunks)
        return self.computed_blocks * self.block_size**2

    @property
    def block_density(self) -> Tensor:
        """Fraction of a causal mask's blocks actually computed (1.0 = no saving; FlexAttention calls 1 minus
        the fraction of all blocks computed its sparsity); call .item() when logging."""
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


def _ordered_blocks(blocks_BQK: Tensor) -> tuple[Tensor, Tensor]:
    """Block occupancy [B, nq, nk] -> (count [B, 1, nq], indices [B, 1, nq, nk] with the used blocks first)."""
    num = blocks_BQK.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks_BQK.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None], indices[:, None]


def document_block_mask(documents: bool, document_ids_BS: Tensor, window: Optional[int], block_size: int) -> BlockMask:
    """BlockMask for causal/document/window masks computed at block level: O((S/block)^2) per row, no [S, S].

    Valid because packed document ids never decrease along a row (documents are contiguous runs; callers pass
    `canonical_document_ids`). For q block i and kv block j <= i, with each block's smallest/largest document id:
      - some pair may attend  <=> the blocks' document ranges overlap (and, with a window, the closest pair is
        within it);
      - every pair attends    <=> j < i, both blocks lie inside one and the same document (and the farthest pair
        is within the window).
    Blocks that may attend but not fully are "partial": the mask_mod decides per element inside them, so the
    result is exact even where the partial test is conservative (windowed documents).
    """
    S = document_ids_BS.shape[1]
    any_allowed, all_allowed = block_occupancy(documents, document_ids_BS, window, block_size)
    partial = any_allowed & ~all_allowed
    kv_num, kv_idx = _ordered_blocks(partial)
    full_num, full_idx = _ordered_blocks(all_allowed)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=get_mask_mod(document_ids_BS if documents else None, window),
        seq_lengths=(S, S),
    )


def block_occupancy(
    documents: bool, document_ids_BS: Tensor, window: Optional[int], block_size: int
) -> tuple[Tensor, Tensor]:
    """(some pair may attend, every pair attends) per (q block, kv block): two [B, nq, nk] bool tensors.

    document_ids_BS must be monotonic along each row (`canonical_document_ids`). A ragged tail is padded with
    a document of its own, which only touches the diagonal block (already counted), so counts are unchanged.
    """
    B, S = document_ids_BS.shape
    n = -(-S // block_size)
    pad = n * block_size - S
    if pad:
        document_ids_BS = torch.nn.functional.pad(document_ids_BS, (0, pad), value=torch.iinfo(torch.int32).max)
    doc = document_ids_BS.view(B, n, block_size)
    lo, hi = doc[..., 0], doc[..., -1]  # monotonic: first/last token hold the smallest/largest id
    q = torch.arange(n, device=doc.device)
    below_or_diag = q[:, None] >= q[None, :]  # [nq, nk]
    strictly_below = q[:, None] > q[None, :]
    any_allowed = below_or_diag.expand(B, n, n).clone()
    all_allowed = strictly_below.expand(B, n, n).clone()
    if documents:
        overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
        single = lo == hi
        same_single = single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
        any_allowed &= overlap
        all_allowed &= same_single
    if window is not None:
        gap = (q[:, None] - q[None, :]) * block_size  # q block start - kv block start
        any_allowed &= (gap - (block_size - 1)) < window  # closest pair: first q vs last kv
        all_allowed &= (gap + (block_size - 1)) < window  # farthest pair: last q vs first kv
    if pad:  # the ragged last block is never entirely allowed
        all_allowed[:, -1, :] = False
        all_allowed[:, :, -1] = False
    return any_allowed, all_allowed


def canonical_document_ids(document_ids_BS: Tensor) -> Tensor:
    """Renumber documents as contiguous runs 0, 1, 2, ... along each row (monotonic, as the block builder needs)."""
    change = torch.zeros_like(document_ids_BS, dtype=torch.int32)
    change[:, 1:] = (document_ids_BS[:, 1:] != document_ids_BS[:, :-1]).to(torch.int32)
    return torch.cumsum(change, dim=-1, dtype=torch.int32)


def _causal_block_count(B: int, S: int, block_size: int) -> int:
    n = -(-S // block_size)
    return B * n * (n + 1) // 2


def build_batch_mask(
    document_ids_BS: Tensor,
    *,
    documents: bool,
    window: Optional[int],
    backend: AttnBackend,
    block_size: int = 128,
    dense_chunk: int = 512,
) -> BatchMask:
    """The mask for one batch of rows [B, S] (causal, + per document, + sliding window) for flex or dense.

    dense_chunk: queries per SDPA call of the dense backend (its keys start at the chunk's earliest document).
    """
    B, S = document_ids_BS.shape
    device = document_ids_BS.device
    document_ids_BS = canonical_document_ids(document_ids_BS)
    mask_mod = get_mask_mod(document_ids_BS if documents else None, window)
    causal_blocks = _causal_block_count(B, S, block_size)
    if backend is AttnBackend.FLEX:
        if S % block_size == 0:
            block_mask = document_block_mask(documents, document_ids_BS, window, block_size)
        else:  # ragged last block: let torch evaluate the mask_mod per element
            block_mask = _create_block_mask(mask_mod, B, S, device, block_size)
        computed = block_mask.kv_num_blocks.sum()
        if block_mask.full_kv_num_blocks is not None:
            computed = computed + block_mask.full_kv_num_blocks.sum()
        return BatchMask(
            documents,
            window,
            backend,
            block_mask=block_mask,
            computed_blocks=computed,
            causal_blocks=causal_blocks,
            block_size=block_size,
        )
    if backend not in (AttnBackend.VARLEN, AttnBackend.DENSE):
        raise ValueError(f"unknown mask backend {backend!r}")
    # these visit no blocks: the density metric counts what a block-sparse kernel would compute
    computed = block_occupancy(documents, document_ids_BS, window, block_size)[0].sum()
    if backend is AttnBackend.VARLEN:
        # one sequence per row unless packed: the causal/sliding_window masks ignore document ids
        ids = document_ids_BS if documents else torch.zeros_like(document_ids_BS)
        plan_calls(ids, window or 0)  # planned now, on the host, once per batch (every layer finds it)
        return BatchMask(
            documents,
            window,
            backend,
            varlen_ids=ids,
            computed_blocks=computed,
            causal_blocks=causal_blocks,
            block_size=block_size,
        )
    chunks = _dense_chunks(documents, mask_mod, document_ids_BS, window, dense_chunk)
    return BatchMask(
        documents,
        window,
        backend,
        dense_chunks=chunks,
        computed_blocks=computed,
        causal_blocks=causal_blocks,
        block_size=block_size,
    )


def _dense_chunks(
    documents: bool, mask_mod, document_ids_BS: Tensor, window: Optional[int], chunk: int
) -> list[DenseChunk]:
    # Keys before the earliest document start of a query chunk (or before its window) can never be attended,
    # so each chunk's SDPA call skips them: dense cost follows the documents, not S^2. Exact either way: the
    # mask still decides inside the kept range. Reading the starts costs one host sync per batch (CPU backend).
    B, S = document_ids_BS.shape
    q_starts = list(range(0, S, chunk))
    idx = torch.tensor(q_starts, device=document_ids_BS.device)
    doc_start = idx - position_ids_from_document_ids(document_ids_BS)[:, idx]  # [B, chunks]
    kv_starts = doc_start.min(dim=0).values if documents else torch.zeros_like(idx)
    if window is not None:
        kv_starts = torch.maximum(kv_starts, (idx - window + 1).clamp(min=0))
    chunks = []
    for q_start, kv_start in zip(q_starts, kv_starts.tolist()):
        q_end = min(q_start + chunk, S)
        mask = dense_mask_from_mod(mask_mod, B, range(q_start, q_end), range(kv_start, q_end), document_ids_BS.device)
        chunks.append(DenseChunk(q_start, q_end, kv_start, mask))
    return chunks


def dense_mask_from_mod(mask_mod, B: int, q_range: range, kv_range: range, device: torch.device) -> Tensor:
    """Evaluate a mask_mod on every (q, kv) pair of the ranges by broadcasting: [B, 1, len(q), len(kv)] bool."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_range.start, q_range.stop, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_range.start, kv_range.stop, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(B, 1, len(q_range), len(kv_range))
