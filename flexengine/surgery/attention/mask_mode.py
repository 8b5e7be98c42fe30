"""`MaskMode`: an inner mask over a row, with or without document separation, in every backend's form.

One object per mode answers all five questions that used to be re-derived in five places:
  - `mask_mod(ids)`: the element-wise predicate over the row (FlexAttention's partial blocks, the dense mask);
  - `block_occupancy(ids, block)`: which (q block, kv block) may / must attend, O((S/block)^2) per row, for
    `BlockMask.from_kv_blocks` and the block-density metric;
  - `key_ranges(ids, chunk)`: the first and last key any query of a chunk may see (dense backend's SDPA calls);
  - `varlen_window` / `varlen_spans(ids)`: the per-document SDPA calls of the varlen backend;
  - `attended_pairs(lengths)`: the (query, key) pairs the mask allows (model FLOPs, MFU).
The document wrapper follows attention-gym's `generate_doc_mask_mod`: a pair attends iff both tokens share a
document and the inner mask allows their document-local positions. Without document separation the whole row
is one document, so the same derivations serve both (tests/surgery/attention/test_mask_mode.py checks them all
against `mask_mod` evaluated densely).

Document ids must be canonical (`canonical_document_ids`: runs numbered 0, 1, 2, ... along each row).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from flexengine.surgery.attention.masks import MODES, Causal, InnerMask, MaskMod, causal_or_window
from flexengine.surgery.attention.masks import position_ids_from_document_ids as _positions
from flexengine.surgery.attention.varlen import build_varlen_plan, document_runs


def canonical_document_ids(document_ids_BS: Tensor) -> Tensor:
    """Renumber documents as contiguous runs 0, 1, 2, ... along each row (monotonic, as the derivations need)."""
    change = torch.zeros_like(document_ids_BS, dtype=torch.int32)
    change[:, 1:] = (document_ids_BS[:, 1:] != document_ids_BS[:, :-1]).to(torch.int32)
    return torch.cumsum(change, dim=-1, dtype=torch.int32)


def document_extents(document_ids_BS: Tensor) -> tuple[Tensor, Tensor]:
    """(start, end) of every token's document: [B, S] each, end exclusive."""
    S = document_ids_BS.shape[-1]
    idx = torch.arange(S, device=document_ids_BS.device)
    to_end = _positions(document_ids_BS.flip(-1)).flip(-1)  # tokens after this one in its document
    return idx - _positions(document_ids_BS), idx + to_end + 1


@dataclass(frozen=True)
class MaskMode:
    """A mask mode: `inner` applied per document (documents=True, packed rows) or to the whole row."""

    inner: InnerMask
    documents: bool  # rows hold several documents, each attending only to itself (positions restart)

    @property
    def name(self) -> str:
        """e.g. `document_sliding_window_4096`."""
        return f"document_{self.inner.name}" if self.documents else self.inner.name

    def packed(self) -> MaskMode:
        """The same inner mask with document separation (an HF attention_mask folds padding into documents)."""
        return dataclasses.replace(self, documents=True)

    def row_ids(self, document_ids_BS: Tensor) -> Tensor:
        """The document ids this mode separates: canonical ids when packed, one document per row otherwise."""
        if self.documents:
            return canonical_document_ids(document_ids_BS)
        return torch.zeros(document_ids_BS.shape, dtype=torch.int32, device=document_ids_BS.device)

    # -- the predicate -----------------------------------------------------------------------------------------
    def mask_mod(self, document_ids_BS: Optional[Tensor]) -> MaskMod:
        """FlexAttention mask_mod over rows of these (canonical) document ids; ignored (may be None) when not
        packed."""
        inner = self.inner
        if not self.documents:  # one document per row: local positions are the row's

            def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return inner.allowed(q_idx, kv_idx)

        elif document_ids_BS is None:
            raise ValueError(f"mask mode {self.name!r} separates documents: its mask_mod needs the document ids")
        elif inner.shift_invariant:  # q - kv is the same in local and row coordinates: skip the offsets
            doc = document_ids_BS

            def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return (doc[b, q_idx] == doc[b, kv_idx]) & inner.allowed(q_idx, kv_idx)

        else:
            doc, start = document_ids_BS, document_extents(document_ids_BS)[0]

            def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                same = doc[b, q_idx] == doc[b, kv_idx]
                return same & inner.allowed(q_idx - start[b, q_idx], kv_idx - start[b, kv_idx])

        mask_mod.__name__ = self.name
        return mask_mod

    # -- block occupancy (flex) --------------------------------------------------------------------------------
    def block_occupancy(self, document_ids_BS: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
        """(some pair may attend, every pair attends) per (q block, kv block): two [B, nq, nk] bool tensors.

        Documents are contiguous runs, so two different blocks share at most one document: the later block's
        first document when it reaches back into the earlier block (on the diagonal, its first document). The
        inner mask's `tile` on that document's part of each block decides; a block wholly inside the document
        on both sides may be entirely allowed. A ragged last block is never entirely allowed (as torch's
        create_block_mask treats the padding)."""
        ids = self.row_ids(document_ids_BS)
        S = ids.shape[1]
        n = -(-S // block_size)
        # int32: these [B, n, n] tensors are the build's whole cost at long rows (128K tokens: 1024^2 per row)
        first_tok = torch.arange(n, device=ids.device, dtype=torch.int32) * block_size
        last_tok = (first_tok + block_size).clamp(max=S) - 1
        lo, hi = ids[:, first_tok], ids[:, last_tok]  # [B, n] a block's first and last document
        start, end = (e[:, first_tok].to(torch.int32) for e in document_extents(ids))  # of its first document
        later_q = lo[:, :, None] >= lo[:, None, :]  # the shared document is the q block's first, else the kv's
        d_start = torch.where(later_q, start[:, :, None], start[:, None, :])  # [B, nq, nk]
        d_end = torch.where(later_q, end[:, :, None], end[:, None, :])
        q_lo = torch.maximum(first_tok[None, :, None], d_start) - d_start
        q_hi = torch.minimum(last_tok[None, :, None], d_end - 1) - d_start
        kv_lo = torch.maximum(first_tok[None, None, :], d_start) - d_start
        kv_hi = torch.minimum(last_tok[None, None, :], d_end - 1) - d_start
        some, every = self.inner.tile(q_lo, q_hi, kv_lo, kv_hi)
        overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
        single = lo == hi
        some = some & overlap
        every = every & overlap & single[:, :, None] & single[:, None, :]
        if S % block_size:  # the padding past S is masked, so the ragged last block is never entirely allowed
            every[:, -1, :] = False
            every[:, :, -1] = False
        return some, every

    # -- dense key ranges --------------------------------------------------------------------------------------
    def key_ranges(self, document_ids_BS: Tensor, chunk: int) -> list[tuple[int, int, int]]:
        """(q_start, kv_start, kv_end) per chunk of `chunk` queries: keys outside [kv_start, kv_end) are seen by
        no query of the chunk in any row, so the dense backend's SDPA call skips them. One host sync."""
        ids = self.row_ids(document_ids_BS)
        B, S = ids.shape
        start, end = document_extents(ids)
        first, last = self.inner.key_interval(_positions(ids))
        kv_first = start + first  # [B, S] in row coordinates
        kv_last = torch.minimum(start + last, end - 1)
        pad = -S % chunk
        kv_first = torch.nn.functional.pad(kv_first, (0, pad), value=S).view(B, -1, chunk)
        kv_last = torch.nn.functional.pad(kv_last, (0, pad), value=-1).view(B, -1, chunk)
        bounds = torch.stack([kv_first.amin(dim=(0, 2)), kv_last.amax(dim=(0, 2)) + 1]).tolist()
        return [(i * chunk, kv_start, kv_end) for i, (kv_start, kv_end) in enumerate(zip(*bounds))]

    # -- varlen ------------------------------------------------------------------------------------------------
    @property
    def varlen_window(self) -> int:
        """The varlen kernel's window argument (0 = whole documents); refuses masks it cannot run."""
        window = self.inner.varlen_window
        if window is None:
            raise NotImplementedError(
                f"attn.backend=varlen runs causal and sliding-window masks only, not {self.name}; "
                "use attn.backend=dense (CPU) or flex (CUDA)"
            )
        return window

    def varlen_spans(self, document_ids_BS: Tensor) -> Tensor:
        """The varlen backend's query spans (attention/varlen.py, `build_varlen_plan`): [spans, 4] int64."""
        return build_varlen_plan(document_runs(self.row_ids(document_ids_BS)), self.varlen_window or None)

    # -- FLOPs -------------------------------------------------------------------------------------------------
    def attended_pairs(self, lengths: list[int]) -> int:
        """(query, key) pairs the mask allows within documents of these lengths (per head, summed)."""
        return sum(self.inner.pairs(n) for n in lengths)


def mask_mode(name: str, window: Optional[int] = None) -> MaskMode:
    """attn.mode + a layer's window -> its MaskMode (a layer without a window: the mode's unwindowed mask)."""
    entry = MODES[name]
    return MaskMode(entry.inner(window), entry.documents)


def band_mode(documents: bool, window: Optional[int]) -> MaskMode:
    """Causal (or sliding-window) attention, per document or over the whole row."""
    return MaskMode(causal_or_window(window), documents)


__all__ = ["Causal", "MaskMode", "band_mode", "canonical_document_ids", "document_extents", "mask_mode"]


def get_mask_mod(document_ids_BS: Optional[Tensor] = None, window: Optional[int] = None) -> MaskMod:
    """Causal mask_mod, per document when ids are given, within `window` if set (`MaskMode.mask_mod` of it)."""
    return band_mode(document_ids_BS is not None, window).mask_mod(document_ids_BS)
