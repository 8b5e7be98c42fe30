"""What a query may see inside its own document: one class per inner mask, in document-local coordinates.

An inner mask answers "may local query `q` see local key `kv`?" where 0 is the first token of the document
(attention-gym's `generate_doc_mask_mod(mask_mod, offsets)` hands its inner mask the same coordinates). It knows
nothing of packing: `MaskMode` (attention/mask_mode.py) wraps it in document separation and derives the forms
each backend needs. Besides the predicate an inner mask states the contiguous key interval [first, last] each
query sees; block occupancy, the dense backend's key ranges and the attended-pair count follow from it.

A new attention pattern is one `InnerMask` subclass here plus one `MODES` entry (and conf/attn/<name>.yaml);
tests/surgery/attention/test_mask_mode.py checks every derived form of every entry against the predicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, ClassVar, NamedTuple, Optional

# torch is imported inside the few functions that compute: composing and checking a job reads MODES (which mode
# packs documents, which takes a window: surgery/attention/job_rules.py), and a config error must not wait for
# torch's import (a bad attn.mode: 0.4 s without it, 6-7 s with torch + transformers on a loaded 2-core machine).
# tests/cli/test_common.py checks that composing a job imports neither.
if TYPE_CHECKING:
    from torch import Tensor

MaskMod = Callable[["Tensor", "Tensor", "Tensor", "Tensor"], "Tensor"]  # FlexAttention's (b, h, q_idx, kv_idx) -> bool


class InnerMask:
    """A causal-like pattern inside one document, in local coordinates. Contract (the derivations rely on it):
    query q sees exactly the keys first(q) <= kv <= last(q), with first and last nondecreasing in q and
    first(q) <= q <= last(q) (a query sees itself, so no softmax row is empty). Override `tile`/`pairs` for a
    mask that is not one interval per query (e.g. attention sinks plus a window)."""

    # allowed(q, kv) depends on q - kv only: inside one document local and global coordinates then give the same
    # answer, so the packed mask_mod skips the two per-element offset gathers (today's cost for causal/window)
    shift_invariant: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """Descriptive name (the mask_mod's `__name__`, the log)."""
        raise NotImplementedError

    def allowed(self, q: Tensor, kv: Tensor) -> Tensor:
        """The element-wise predicate: may local query q see local key kv (broadcasting int tensors)?"""
        raise NotImplementedError

    def key_interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """(first, last) local key query q sees; last may run past the document's end (the caller clips it)."""
        raise NotImplementedError

    @property
    def varlen_window(self) -> Optional[int]:
        """The varlen backend's form: 0 = causal over whole documents, w = the last w keys, None = it cannot
        run this mask (its kernel calls are causal spans and fixed-width bands only)."""
        return None

    def tile(self, q_lo: Tensor, q_hi: Tensor, kv_lo: Tensor, kv_hi: Tensor) -> tuple[Tensor, Tensor]:
        """(some pair may attend, every pair attends) for local query range [q_lo, q_hi] x key range
        [kv_lo, kv_hi] (inclusive, element-wise tensors): exact for interval masks (see the class contract)."""
        first_lo, last_lo = self.key_interval(q_lo)
        first_hi, last_hi = self.key_interval(q_hi)
        some = (first_lo <= kv_hi) & (last_hi >= kv_lo)  # the earliest first and the latest last reach the keys
        every = (first_hi <= kv_lo) & (last_lo >= kv_hi)  # the narrowest ends still cover them
        return some, every

    def pairs(self, n: int) -> int:
        """(query, key) pairs allowed inside a document of n tokens (model FLOPs)."""
        return _interval_pairs(self, n)


@lru_cache(maxsize=4096)
def _interval_pairs(inner: InnerMask, n: int) -> int:
    # generic count from the key interval: O(n) once per (mask, length); Causal/SlidingWindow have closed forms
    import torch

    first, last = inner.key_interval(torch.arange(n, dtype=torch.int64))
    return int((last.clamp(max=n - 1) - first + 1).clamp(min=0).sum())


@dataclass(frozen=True)
class Causal(InnerMask):
    """A query sees itself and every earlier key of its document."""

    shift_invariant: ClassVar[bool] = True

    @property
    def name(self) -> str:
        """`causal`."""
        return "causal"

    def allowed(self, q: Tensor, kv: Tensor) -> Tensor:
        """kv <= q."""
        return q >= kv

    def key_interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """[0, q]."""
        import torch

        return torch.zeros_like(q), q

    @property
    def varlen_window(self) -> Optional[int]:
        """Whole documents, one is_causal call each."""
        return 0

    def pairs(self, n: int) -> int:
        """n (n + 1) / 2."""
        return n * (n + 1) // 2


@dataclass(frozen=True)
class SlidingWindow(InnerMask):
    """A query sees the `window` most recent keys including itself (HF's `sliding_window`: kv > q - window)."""

    window: int
    shift_invariant: ClassVar[bool] = True

    @property
    def name(self) -> str:
        """`sliding_window_<window>`."""
        return f"sliding_window_{self.window}"

    def allowed(self, q: Tensor, kv: Tensor) -> Tensor:
        """0 <= q - kv < window."""
        return (q >= kv) & (q - kv < self.window)

    def key_interval(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """[max(0, q - window + 1), q]."""
        return (q - self.window + 1).clamp(min=0), q

    @property
    def varlen_window(self) -> Optional[int]:
        """A causal span, then band chunks of `window` keys."""
        return self.window

    def pairs(self, n: int) -> int:
        """The first `window` queries see 1..window keys, the rest `window` each."""
        w = min(self.window, n)
        return w * (w + 1) // 2 + (n - w) * w


def causal_or_window(window: Optional[int]) -> InnerMask:
    """SlidingWindow(window), or Causal on a layer without a window (a model's full-attention layers)."""
    return Causal() if window is None else SlidingWindow(window)


class ModeEntry(NamedTuple):
    """One attn.mode: whether rows hold several documents, whether it takes a window, and its inner mask."""

    documents: bool  # "packed X": document separation around the inner mask (attention/mask_mode.py)
    windowed: bool  # takes the model's sliding window (or attn.window); layers without one get inner(None)
    inner: Callable[[Optional[int]], InnerMask]  # the layer's window -> the inner mask


# attn.mode -> its entry. "packed X" is X with document separation around it, not a new mask.
MODES: dict[str, ModeEntry] = {
    "causal": ModeEntry(False, False, lambda window: Causal()),
    "packed_doc": ModeEntry(True, False, lambda window: Causal()),
    "sliding_window": ModeEntry(False, True, causal_or_window),
    "packed_sliding": ModeEntry(True, True, causal_or_window),
}


def document_ids_from_position_ids(position_ids_BS: Tensor) -> Tensor:
    """Document index of every token: a new document starts wherever the position id restarts at 0."""
    import torch

    return torch.cumsum((position_ids_BS == 0).to(torch.int32), dim=-1)


def position_ids_from_document_ids(document_ids_BS: Tensor) -> Tensor:
    """Position of every token within its document (RoPE restarts at each document)."""
    import torch

    S = document_ids_BS.shape[-1]
    idx = torch.arange(S, device=document_ids_BS.device).expand_as(document_ids_BS)
    starts = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    # index of the most recent document start at or before each token
    start_idx = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - start_idx
