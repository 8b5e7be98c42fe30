"""Serve packed rows as micro-batches: seeded per-epoch shuffle, per-rank shard, and a resumable position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence, Union

import numpy as np
import torch

from flexengine.core.config import DataConfig
from flexengine.data.corpus import Corpus
from flexengine.data.packing import PackPlan, materialise_rows
from flexengine.data.targets import predicting_positions


def row_token_counts(plan: PackPlan) -> np.ndarray:
    """Real (non-padding) tokens in each packed row."""
    return np.array([sum(seg[2] for seg in row) for row in plan.rows], dtype=np.int64)


def epoch_order(
    row_tokens: np.ndarray,
    *,
    seed: int,
    epoch: int,
    micro_batch: int,
    shuffle: bool = True,
    bucket: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> np.ndarray:
    """Row indices one rank reads in one epoch, consecutive micro_batch rows forming a batch; depends only on
    (seed, epoch) and the row lengths, which is what makes resuming exact."""
    n = len(row_tokens)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n) if shuffle else np.arange(n)
    global_batch = micro_batch * world_size
    short = -n % global_batch
    # Fill the last global batch with rows from the start of this epoch's order: every row is trained each
    # epoch (a few twice) instead of the remainder silently never being seen with shuffle=false.
    order = np.concatenate([order, order[:short]])
    if bucket:
        # similar lengths in one batch (less padding), batches themselves in random order
        order = order[np.argsort(row_tokens[order], kind="stable")]
        batches = order.reshape(-1, global_batch)
        order = batches[rng.permutation(len(batches))].reshape(-1)
    # each rank takes its own micro_batch slice of every global batch
    return order.reshape(-1, world_size, micro_batch)[:, rank].reshape(-1)


def batch_useful_fraction(
    row_tokens: np.ndarray, order: np.ndarray, micro_batch: int, seq_len: int, trim_padding: bool
) -> float:
    """Non-padding tokens / tokens computed when `order` is read in micro-batches (trim_padding: each batch is
    as wide as its longest row, else seq_len)."""
    batches = row_tokens[order].reshape(-1, micro_batch)
    width = batches.max(axis=1) if trim_padding else np.full(len(batches), seq_len)
    return float(batches.sum() / max(1, (width * micro_batch).sum()))


# A micro-batch: LongTensors input_ids, labels, position_ids, document_ids [rows, width] and predicting_index, plus
# host-side facts (never copied to the device): useful_tokens (int), document_lengths (list[int]).
Batch = dict[str, Union[torch.Tensor, int, list[int]]]


def make_batch(
    corpus: Corpus,
    plan: PackPlan,
    rows: Union[Sequence[int], np.ndarray],
    seq_len: int,
    pad_id: int,
    trim_padding: bool = False,
) -> Batch:
    """The micro-batch of the given plan rows (-1 = an all-padding row that has no target); trim_padding cuts
    it to its longest row."""
    segments = [plan.rows[r] if r >= 0 else [] for r in rows]
    tensors = materialise_rows(segments, corpus.tokens, corpus.offsets, seq_len, pad_id, corpus.loss_mask)
    lengths = [sum(seg[2] for seg in row) for row in segments]
    if trim_padding:
        tensors = {k: v[:, : max(1, max(lengths))] for k, v in tensors.items()}
    return {
        **tensors,
        # host-side facts: real tokens, and the length of every document piece
        "useful_tokens": sum(lengths),
        "document_lengths": [seg[2] for row in segments for seg in row],
        "predicting_index": predicting_positions(tensors["labels"]),  # host-side: no device sync in the loss
    }


@dataclass
class HeldOut:
    """The held-out rows, served as this rank's micro-batches, each row exactly once, in plan order.

    Every rank gets the same number of batches (collectives in the forward must pair up): the last global
    batch is filled with all-padding rows, which carry no target and so add nothing to the eval loss.
    max_batches > 0 keeps only the first that many global batches (the same rows at every evaluation).
    """

    corpus: Corpus
    plan: PackPlan
    seq_len: int
    micro_batch: int
    pad_id: int
    trim_padding: bool = False
    max_batches: int = 0
    rank: int = 0
    world_size: int = 1

    @property
    def num_batches(self) -> int:
        """Micro-batches each rank evaluates: the held-out rows in global batches, at most max_batches of them."""
        batches = -(-len(self.plan.rows) // (self.micro_batch * self.world_size))
        return min(batches, self.max_batches) if self.max_batches > 0 else batches

    def batches(self) -> Iterator[Batch]:
        """This rank's micro-batches (built lazily: a large held-out set never sits in memory as tensors)."""
        global_batch = self.micro_batch * self.world_size
        n = len(self.plan.rows)
        order = np.concatenate([np.arange(n), np.full(-n % global_batch, -1)])
        order = order.reshape(-1, self.world_size, self.micro_batch)
        if self.max_batches > 0:
            order = order[: self.max_batches]
        for rows in order[:, self.rank]:
            yield make_batch(self.corpus, self.plan, rows, self.seq_len, self.pad_id, self.trim_padding)


def data_plan_fingerprint(
    corpus: Corpus, plan: PackPlan, *, data: DataConfig, micro_batch: int, world_size: int, cp: int, seed: int
) -> dict:
    """What the order and content of the batches depend on, by config key: stored in every checkpoint, so a
    resume onto another data stream (other documents, held-out split, mixture, seq_len, packing, micro_batch,
    ranks, context parallelism, seed) is noticed. `rows_sha256` covers every input that changes the packed
    training rows; the named keys beside it say which setting changed. cp: the world_size / cp data-parallel
    groups each read their own rows, so another parallel.cp at the same world size gives a rank other rows."""
    return {
        "corpus_sha256": corpus.fingerprint(),
        "documents": len(corpus),
        "data.seq_len": data.seq_len,
        "data.packing": data.packing,
        "data.long_docs": data.long_docs,
        "data.shuffle": data.shuffle,
        "data.bucket": data.bucket,
        "data.eval_fraction": data.eval_fraction,
        "data.mix": [f"{m.path}:{m.weight:g}" for m in data.mix],
        "train.micro_batch": micro_batch,
        "world_size": world_size,
        "parallel.cp": cp,
        "train.seed": seed,
        "rows_sha256": plan.sha256(),  # last: listed after its cause
    }


class RowLoader:
    """Endless micro-batches [micro_batch, seq_len] over the rows of a PackPlan, epoch after epoch.

    The epoch order depends only on (seed, epoch), so `state_dict()` = (epoch, cursor) resumes exactly.
    With `trim_padding` (one document per row) each batch is cut to its longest document. Tensors go to the
    device; `useful_tokens` (int) and `document_lengths` (list of the rows' document pieces) stay on the host.
    """

    def __init__(
        self,
        corpus: Corpus,
        plan: PackPlan,
        *,
        seq_len: int,
        micro_batch: int,
        pad_id: int,
        seed: int = 0,
        shuffle: bool = True,
        bucket: bool = False,
        trim_padding: bool = False,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
    ):
        if len(plan.rows) < micro_batch * world_size:
            raise ValueError(
                f"only {len(plan.rows)} packed rows for micro_batch={micro_batch} x {world_size} rank(s): "
                "use more documents or a smaller train.micro_batch / data.seq_len"
            )
        self.corpus, self.plan, self.seq_len, self.micro_batch = corpus, plan, seq_len, micro_batch
        self.pad_id, self.seed, self.shuffle, self.bucket = pad_id, seed, shuffle, bucket
        self.trim_padding, self.rank, self.world_size = trim_padding, rank, world_size
        # pinned host tensors make the trainer's non_blocking copies real async DMA (pageable ones are staged
        # through a bounce buffer and block the host)
        self.pin_memory = pin_memory
        self.row_tokens = row_token_counts(plan)
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices of this rank for one epoch, grouped so consecutive micro_batch rows form a batch."""
        return epoch_order(
            self.row_tokens,
            seed=self.seed,
            epoch=epoch,
            micro_batch=self.micro_batch,
            shuffle=self.shuffle,
            bucket=self.bucket,
            rank=self.rank,
            world_size=self.world_size,
        )

    def useful_fraction(self, epoch: int = 0) -> float:
        """Non-padding tokens / tokens computed over one epoch of this rank (trim_padding cuts each batch to its
        longest row, so this is what one-document-per-row training really pays for padding)."""
        return batch_useful_fraction(
            self.row_tokens, self._epoch_order(epoch), self.micro_batch, self.seq_len, self.trim_padding
        )

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches each rank sees per epoch."""
        return len(self._order) // self.micro_batch

    def next_batch(self) -> Batch:
        """The next micro-batch (wrapping into a new, reshuffled epoch)."""
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._epoch_order(self.epoch)
        rows = self._order[self.cursor : self.cursor + self.micro_batch]
        self.cursor += self.micro_batch
        batch = make_batch(self.corpus, self.plan, rows, self.seq_len, self.pad_id, self.trim_padding)
        if self.pin_memory:
            batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """Position in the data stream (for exact resume)."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "rows": len(self.plan.rows)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; refuses a different packing (its rows would not match)."""
        if state["rows"] != len(self.plan.rows) or state["seed"] != self.seed:
            raise ValueError(
                f"checkpoint data position is for {state['rows']} rows / seed {state['seed']}, but this run has "
                f"{len(self.plan.rows)} rows / seed {self.seed}: resume with the same data and packing settings"
            )
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order(self.epoch)
