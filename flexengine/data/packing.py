"""Pack tokenized documents into fixed-length rows: best-fit decreasing, greedy (data order) or one per row.

Packing is planned on lengths only (`plan_packing`: which piece of which document goes in which row) and
materialised per batch (`materialise_rows`), so 20k long documents never exist as padded tensors at once.
Every token the long-document policy splits, truncates or drops is counted in `PackStats`.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

IGNORE_INDEX = -100  # label value the loss skips (HF convention)

# One piece of a document placed in a row: (document index, first token, number of tokens).
Segment = tuple[int, int, int]


@dataclass
class PackStats:
    """What packing did to the corpus; nothing is dropped without a count here."""

    documents: int = 0  # documents given
    tokens_in: int = 0  # their tokens before the long-document policy
    tokens: int = 0  # tokens placed in rows
    rows: int = 0
    seq_len: int = 0
    documents_split: int = 0  # longer than seq_len, cut into seq_len pieces (each its own document)
    documents_truncated: int = 0
    tokens_truncated: int = 0
    documents_dropped: int = 0
    tokens_dropped: int = 0

    @property
    def useful_token_fraction(self) -> float:
        """Non-padding tokens / all row slots."""
        return self.tokens / max(1, self.rows * self.seq_len)

    @property
    def documents_per_row(self) -> float:
        """Mean number of document pieces per row."""
        return self.pieces / max(1, self.rows)

    pieces: int = 0  # document pieces placed (documents after splitting, minus dropped)
    longest_piece: int = 0  # tokens of the longest piece in a row: the highest position a row reaches + 1

    def as_dict(self) -> dict:
        """Plain dict for logs and summary.json."""
        d = asdict(self)
        d["useful_token_fraction"] = self.useful_token_fraction
        d["documents_per_row"] = self.documents_per_row
        return d

    def describe(self) -> str:
        """One readable log line: what went in, what came out, and what the long-document policy did."""
        line = (
            f"{self.documents:,} documents ({self.tokens_in:,} tokens) -> {self.rows:,} rows of {self.seq_len:,} "
            f"tokens, {self.documents_per_row:.1f} documents/row, {self.useful_token_fraction:.1%} of slots useful; "
            f"longest piece {self.longest_piece:,} tokens"
        )
        changed = [
            f"{n:,} {what}" + (f" ({t:,} tokens)" if t else "")
            for n, t, what in (
                (self.documents_split, 0, "split"),
                (self.documents_truncated, self.tokens_truncated, "truncated"),
                (self.documents_dropped, self.tokens_dropped, "dropped"),
            )
            if n
        ]
        return line + (f"; longer than seq_len: {', '.join(changed)}" if changed else "")


@dataclass
class PackPlan:
    """Rows as lists of segments, plus the accounting."""

    rows: list[list[Segment]] = field(default_factory=list)
    stats: PackStats = field(default_factory=PackStats)

    def sha256(self) -> str:
        """Hex sha256 of the rows: every (document, start, length) piece and where each row ends. It changes with
        anything that changes which documents are trained on and how (held-out split, mixture, max_docs, ...)."""
        h = hashlib.sha256(np.asarray([len(row) for row in self.rows], dtype=np.int64).tobytes())
        h.update(np.asarray([seg for row in self.rows for seg in row], dtype=np.int64).tobytes())
        return h.hexdigest()


Lengths = Union[Sequence[int], np.ndarray]  # tokens per document: a list, or the corpus's int array
Indices = Union[Sequence[int], np.ndarray]  # which documents: a list, or an int array (a split's)


def _pieces(lengths: Lengths, seq_len: int, long_docs: str, stats: PackStats, documents: Indices) -> list[Segment]:
    pieces: list[Segment] = []
    for doc in documents:
        doc, length = int(doc), int(lengths[doc])
        stats.tokens_in += length
        if length == 0:
            continue
        if length <= seq_len:
            pieces.append((doc, 0, length))
        elif long_docs == "split":
            stats.documents_split += 1
            pieces.extend((doc, start, min(seq_len, length - start)) for start in range(0, length, seq_len))
        elif long_docs == "truncate":
            stats.documents_truncated += 1
            stats.tokens_truncated += length - seq_len
            pieces.append((doc, 0, seq_len))
        elif long_docs == "drop":
            stats.documents_dropped += 1
            stats.tokens_dropped += length
        else:
            raise ValueError(f"long_docs={long_docs!r}: choose split, truncate or drop")
    return pieces


def _best_fit_decreasing(pieces: list[Segment], seq_len: int) -> list[list[Segment]]:
    # Rows are bucketed by remaining capacity; `caps` is the sorted list of capacities that have open rows, so
    # the best fit (smallest capacity >= piece) is one bisect: O(n log seq_len) overall.
    rows: list[list[Segment]] = []
    rows_by_cap: dict[int, list[int]] = {}
    caps: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p[2]):
        length = piece[2]
        i = bisect.bisect_left(caps, length)
        if i == len(caps):
            row, cap = len(rows), seq_len
            rows.append([])
        else:
            cap = caps[i]
            row = rows_by_cap[cap].pop()
            if not rows_by_cap[cap]:
                del rows_by_cap[cap]
                del caps[i]
        rows[row].append(piece)
        cap -= length
        if cap > 0:
            if cap not in rows_by_cap:
                rows_by_cap[cap] = []
                bisect.insort(caps, cap)
            rows_by_cap[cap].append(row)
    return rows


def _greedy(pieces: list[Segment], seq_len: int) -> list[list[Segment]]:
    rows: list[list[Segment]] = []
    used = seq_len  # forces a new row for the first piece
    for piece in pieces:
        if used + piece[2] > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += piece[2]
    return rows


def plan_packing(
    lengths: Lengths,
    seq_len: int,
    strategy: str = "bfd",
    long_docs: str = "split",
    documents: Optional[Indices] = None,
) -> PackPlan:
    """Decide which document pieces go into which row of `seq_len` tokens. documents: the indices to pack
    (e.g. the training side of a held-out split); None = all of them."""
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len} must be positive")
    documents = range(len(lengths)) if documents is None else documents
    stats = PackStats(documents=len(documents), seq_len=seq_len)
    pieces = _pieces(lengths, seq_len, long_docs, stats, documents)
    if strategy == "bfd":
        rows = _best_fit_decreasing(pieces, seq_len)
    elif strategy == "greedy":
        rows = _greedy(pieces, seq_len)
    elif strategy == "none":
        rows = [[p] for p in pieces]
    else:
        raise ValueError(f"strategy={strategy!r}: choose bfd, greedy or none")
    stats.rows = len(rows)
    stats.pieces = len(pieces)
    stats.tokens = sum(p[2] for p in pieces)
    stats.longest_piece = max((p[2] for p in pieces), default=0)
    return PackPlan(rows=rows, stats=stats)


def has_targets(plan: PackPlan, offsets: np.ndarray, loss_mask: Optional[np.ndarray] = None) -> bool:
    """Whether any row has a token to predict: a trained token after the first one of its piece (the first
    token of every piece has no target, see `materialise_rows`). Stops at the first one found."""
    for row in plan.rows:
        for doc, start, length in row:
            if length < 2:
                continue
            if loss_mask is None:
                return True
            first = offsets[doc] + start
            if loss_mask[first + 1 : first + length].any():
                return True
    return False


def materialise_rows(
    rows: Sequence[list[Segment]],
    tokens: np.ndarray,
    offsets: np.ndarray,
    seq_len: int,
    pad_id: int,
    loss_mask: Optional[np.ndarray] = None,
) -> dict[str, torch.Tensor]:
    """Build [len(rows), seq_len] input_ids / labels / position_ids / document_ids for the given rows.

    tokens: flat token array of the corpus; offsets[i]:offsets[i+1] is document i. loss_mask (same shape as
    tokens, bool) marks tokens that are trained on (chat: assistant turns); None = all. Labels are -100 on
    padding and on the first token of every piece: nothing learns to predict the next document's start.
    Padding is its own document (position ids restart), so it never attends to real tokens.
    """
    n = len(rows)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((n, seq_len), dtype=np.int64)
    document_ids = np.zeros((n, seq_len), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for d, (doc, start, length) in enumerate(row):
            src = slice(offsets[doc] + start, offsets[doc] + start + length)
            dst = slice(at, at + length)
            input_ids[r, dst] = tokens[src]
            labels[r, dst] = tokens[src]
            if loss_mask is not None:
                labels[r, dst][~loss_mask[src]] = IGNORE_INDEX
            labels[r, at] = IGNORE_INDEX
            position_ids[r, dst] = np.arange(length)
            document_ids[r, dst] = d
            at += length
        # Padding is its own document (document_ids); in a one-document row its positions continue instead of
        # restarting, so HF's own attention (the padded sdpa baseline) does not read the row as packed and
        # fall off its causal fast path. Real tokens never see the padding after them either way.
        position_ids[r, at:] = np.arange(at, seq_len) if len(row) == 1 else np.arange(seq_len - at)
        document_ids[r, at:] = len(row)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "document_ids": torch.from_numpy(document_ids),
    }


def flatten_documents(docs: Sequence[Union[Sequence[int], np.ndarray, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    """list of token lists -> (flat tokens, offsets[n+1])."""
    arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return tokens, offsets


def pack_documents(
    docs: Sequence[Union[Sequence[int], np.ndarray, torch.Tensor]],
    seq_len: int,
    strategy: str = "bfd",
    long_docs: str = "split",
    pad_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Pack token lists into rows: dict of LongTensors [rows, seq_len] (input_ids, labels, position_ids,
    document_ids); `stats` is available as `plan_packing(...)` for the same arguments."""
    tokens, offsets = flatten_documents(docs)
    plan = plan_packing(np.diff(offsets), seq_len, strategy, long_docs)
    return materialise_rows(plan.rows, tokens, offsets, seq_len, pad_id)


def packer(lengths: Lengths, packing: str, long_docs: str) -> Callable[[int], tuple[PackStats, list[list[int]]]]:
    """These documents packed at any row length: (the packing's statistics, each row as its pieces' lengths, what
    the mask separates). What the planner's data.seq_len=auto weighs, handed down by run.py and the plan command."""

    def pack(seq_len: int) -> tuple[PackStats, list[list[int]]]:
        plan = plan_packing(lengths, seq_len, packing, long_docs)
        return plan.stats, [[length for _doc, _start, length in row] for row in plan.rows]

    return pack
