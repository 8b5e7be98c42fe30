"""RowLoader: seeded epochs, exact resume across epoch boundaries, rank sharding, padding accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexengine.core.config import DataConfig
from flexengine.core.distributed import DistInfo
from flexengine.data.corpus import Corpus
from flexengine.data.loader import (
    RowLoader,
    batch_useful_fraction,
    data_plan_fingerprint,
    epoch_order,
    row_token_counts,
)
from flexengine.data.packing import flatten_documents, plan_packing

SEQ_LEN = 32


def _corpus_and_plan(strategy: str = "bfd", n: int = 50):
    rng = np.random.default_rng(1)
    tokens, offsets = flatten_documents([rng.integers(2, 500, int(k)) for k in rng.integers(1, 40, n)])
    corpus = Corpus(tokens=tokens, offsets=offsets)
    return corpus, plan_packing(corpus.lengths, SEQ_LEN, strategy)


def _loader(corpus, plan, **kw) -> RowLoader:
    return RowLoader(corpus, plan, seq_len=SEQ_LEN, micro_batch=kw.pop("micro_batch", 2), pad_id=0, **kw)


def _take(loader: RowLoader, n: int) -> list[torch.Tensor]:
    return [loader.next_batch()["input_ids"] for _ in range(n)]


def test_resume_continues_exactly_across_epochs():
    corpus, plan = _corpus_and_plan()
    reference = _loader(corpus, plan, seed=7)
    per_epoch = reference.batches_per_epoch
    stream = _take(reference, 3 * per_epoch)
    for stop in (1, per_epoch - 1, per_epoch, per_epoch + 2):
        first = _loader(corpus, plan, seed=7)
        _take(first, stop)
        resumed = _loader(corpus, plan, seed=7)
        resumed.load_state_dict(first.state_dict())
        for got, want in zip(_take(resumed, per_epoch + 1), stream[stop:]):
            assert torch.equal(got, want)


def test_each_epoch_is_a_seeded_permutation():
    corpus, plan = _corpus_and_plan()
    loader = _loader(corpus, plan, seed=3, micro_batch=1)
    n = len(plan.rows)

    def order(seed: int, epoch: int, **kw) -> np.ndarray:
        return epoch_order(loader.row_tokens, seed=seed, epoch=epoch, micro_batch=1, **kw)

    epochs = [order(3, e) for e in range(2)]
    assert sorted(epochs[0].tolist()) == list(range(n)) and not np.array_equal(epochs[0], epochs[1])
    assert np.array_equal(epochs[0], order(3, 0))  # same seed -> same order
    assert not np.array_equal(epochs[0], order(4, 0))
    assert np.array_equal(order(3, 0, shuffle=False), np.arange(n))


def test_ranks_split_each_global_batch():
    _, plan = _corpus_and_plan()
    rt = row_token_counts(plan)
    full = epoch_order(rt, seed=0, epoch=0, micro_batch=2, world_size=1)  # micro_batch 2 x 1 rank
    shards = [epoch_order(rt, seed=0, epoch=0, micro_batch=1, rank=r, world_size=2) for r in range(2)]
    assert np.array_equal(np.stack(shards, axis=1).reshape(-1), full[: 2 * len(shards[0])])


def test_resume_refuses_a_different_packing():
    corpus, plan = _corpus_and_plan("bfd")
    state = _loader(corpus, plan).state_dict()
    other_corpus, other_plan = _corpus_and_plan("greedy")
    with pytest.raises(ValueError, match="same data and packing"):
        _loader(other_corpus, other_plan).load_state_dict(state)


def test_data_plan_names_a_change_of_context_parallelism():
    """At one world size, parallel.cp changes which rows a rank reads (world / cp groups, group rank // cp): the
    fingerprint a checkpoint stores says so, by key, so a resume with another cp is refused like other changes."""
    corpus, plan = _corpus_and_plan()
    first_rows, prints = {}, {}
    for cp in (1, 2):
        rank1 = DistInfo(rank=1, world_size=4, cp=cp)
        loader = _loader(corpus, plan, rank=rank1.data_rank, world_size=rank1.data_world_size)
        first_rows[cp] = loader.next_batch()["input_ids"]
        prints[cp] = data_plan_fingerprint(
            corpus, plan, data=DataConfig(seq_len=SEQ_LEN), micro_batch=2, world_size=4, cp=cp, seed=0
        )
    assert not torch.equal(first_rows[1], first_rows[2])  # the same rank reads other rows
    assert [k for k in prints[1] if prints[1][k] != prints[2][k]] == ["parallel.cp"]


@pytest.mark.parametrize("bucket", [False, True])
def test_trimmed_batches_and_their_useful_fraction(bucket):
    corpus, plan = _corpus_and_plan("none")
    loader = _loader(corpus, plan, micro_batch=4, trim_padding=True, bucket=bucket, seed=5)
    useful = slots = 0
    for _ in range(loader.batches_per_epoch):
        batch = loader.next_batch()
        real = int((batch["input_ids"] != 0).sum())
        assert batch["input_ids"].shape[1] == int((batch["input_ids"] != 0).sum(1).max())  # cut to the longest
        assert int(batch["useful_tokens"]) == real
        useful, slots = useful + real, slots + batch["input_ids"].numel()
    assert loader.useful_fraction(0) == pytest.approx(useful / slots)
    order = epoch_order(loader.row_tokens, seed=5, epoch=0, micro_batch=4, bucket=bucket)
    expected = useful / (len(order) * SEQ_LEN)
    assert batch_useful_fraction(loader.row_tokens, order, 4, SEQ_LEN, False) == pytest.approx(expected)


def test_every_row_is_read_each_epoch_even_when_batches_do_not_divide_it():
    from flexengine.data.loader import epoch_order

    for shuffle in (False, True):
        order = epoch_order(np.full(10, 5), seed=0, epoch=0, micro_batch=4, shuffle=shuffle)
        assert len(order) % 4 == 0 and set(order.tolist()) == set(range(10))
