"""Packing: exact token accounting per long-document policy, a brute-force best-fit reference, row contents."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flexengine.data.packing import IGNORE_INDEX, flatten_documents, has_targets, materialise_rows, plan_packing
from flexengine.data.targets import count_valid_targets

SEQ_LEN = 64


def _docs(n: int = 60, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, SEQ_LEN, n - 6), [SEQ_LEN, SEQ_LEN + 1, 150, 200, 3 * SEQ_LEN, 5]])
    rng.shuffle(lengths)
    return [rng.integers(2, 1000, int(n)) for n in lengths]  # ids >= 2: 0 is the pad id here


def _expected_docs(docs: list[np.ndarray], long_docs: str) -> list[np.ndarray]:
    """What each document should contribute after the long-document policy (independent of the packer)."""
    if long_docs == "split":
        return list(docs)
    if long_docs == "truncate":
        return [d[:SEQ_LEN] for d in docs]
    return [d if len(d) <= SEQ_LEN else d[:0] for d in docs]


def _reassemble(plan, batch, n_docs: int) -> list[np.ndarray]:
    """Per corpus document, its tokens as found in the materialised rows (pieces in start order)."""
    pieces: dict[int, list] = {i: [] for i in range(n_docs)}
    ids, doc_ids = batch["input_ids"].numpy(), batch["document_ids"].numpy()
    for r, row in enumerate(plan.rows):
        for d, (doc, start, _) in enumerate(row):
            pieces[doc].append((start, ids[r][doc_ids[r] == d]))
    return [
        np.concatenate([t for _, t in sorted(pieces[i], key=lambda p: p[0])] or [np.zeros(0, int)])
        for i in range(n_docs)
    ]


@pytest.mark.parametrize("strategy", ["bfd", "greedy", "none"])
@pytest.mark.parametrize("long_docs", ["split", "truncate", "drop"])
def test_every_token_accounted_for(strategy, long_docs):
    docs = _docs()
    tokens, offsets = flatten_documents(docs)
    plan = plan_packing(np.diff(offsets), SEQ_LEN, strategy, long_docs)
    batch = materialise_rows(plan.rows, tokens, offsets, SEQ_LEN, pad_id=0)
    expected = _expected_docs(docs, long_docs)
    # useful (non-padding) tokens in the rows == document tokens after the policy, token for token
    assert int((batch["input_ids"] != 0).sum()) == sum(len(d) for d in expected) == plan.stats.tokens
    for got, want in zip(_reassemble(plan, batch, len(docs)), expected):
        np.testing.assert_array_equal(got, want)
    s = plan.stats
    longer = sum(len(d) > SEQ_LEN for d in docs)
    assert s.tokens_in == sum(len(d) for d in docs)
    assert s.tokens_in == s.tokens + s.tokens_truncated + s.tokens_dropped
    assert (s.documents_split, s.documents_truncated, s.documents_dropped) == {
        "split": (longer, 0, 0),
        "truncate": (0, longer, 0),
        "drop": (0, 0, longer),
    }[long_docs]
    assert s.useful_token_fraction == pytest.approx(s.tokens / (s.rows * SEQ_LEN))
    assert all(sum(seg[2] for seg in row) <= SEQ_LEN for row in plan.rows)


def _reference_best_fit_rows(lengths, seq_len: int) -> int:
    """Textbook best-fit decreasing: scan every open row for the tightest fit (O(n^2))."""
    pieces = []
    for n in lengths:
        pieces += [min(seq_len, n - s) for s in range(0, n, seq_len)]
    free: list[int] = []
    for p in sorted(pieces, reverse=True):
        fits = [i for i, f in enumerate(free) if f >= p]
        if fits:
            best = min(fits, key=lambda i: free[i])
            free[best] -= p
        else:
            free.append(seq_len - p)
    return len(free)


@pytest.mark.parametrize("seed", range(5))
def test_bfd_matches_reference_and_beats_greedy(seed):
    lengths = np.random.default_rng(seed).integers(1, 3 * SEQ_LEN, 300)
    bfd = plan_packing(lengths, SEQ_LEN, "bfd")
    assert bfd.stats.rows == _reference_best_fit_rows(lengths, SEQ_LEN)
    assert bfd.stats.rows <= plan_packing(lengths, SEQ_LEN, "greedy").stats.rows
    assert bfd.stats.rows >= -(-lengths.sum() // SEQ_LEN)  # can't beat the volume bound


def test_greedy_keeps_data_order():
    lengths = [30, 30, 10, 50, 20]
    rows = plan_packing(lengths, SEQ_LEN, "greedy").rows
    assert [[seg[0] for seg in row] for row in rows] == [[0, 1], [2, 3], [4]]


def test_rows_restart_positions_and_mask_document_starts():
    docs = [np.arange(10, 30), np.arange(100, 200)]  # the second splits into 64 + 36
    tokens, offsets = flatten_documents(docs)
    plan = plan_packing(np.diff(offsets), SEQ_LEN, "bfd")
    batch = materialise_rows(plan.rows, tokens, offsets, SEQ_LEN, pad_id=0)
    for r, row in enumerate(plan.rows):
        at = 0
        for d, (_, _, length) in enumerate(row):
            span = slice(at, at + length)
            assert batch["position_ids"][r, span].tolist() == list(range(length))
            assert (batch["document_ids"][r, span] == d).all()
            assert batch["labels"][r, at] == IGNORE_INDEX  # never learn to predict a new document's start
            inside = slice(at + 1, at + length)
            assert batch["labels"][r, inside].tolist() == batch["input_ids"][r, inside].tolist()
            at += length
        assert (batch["labels"][r, at:] == IGNORE_INDEX).all()  # padding
        assert (batch["document_ids"][r, at:] == len(row)).all()  # padding is its own document


def test_loss_mask_becomes_ignore_labels():
    tokens, offsets = flatten_documents([np.arange(5, 15)])
    mask = np.array([False] * 4 + [True] * 6)
    batch = materialise_rows([[(0, 0, 10)]], tokens, offsets, 16, 0, mask)
    assert batch["labels"][0, :10].tolist() == [IGNORE_INDEX] * 4 + list(range(9, 15))


def test_20k_long_documents_pack_fast_and_tight():
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(5000), 0.6, 20_000), 64, 30_000).astype(int)
    start = time.perf_counter()
    plan = plan_packing(lengths, 8192, "bfd")
    # A loose bound that survives a loaded CI machine yet catches an accidental O(n^2) packer (which takes
    # minutes here); the speed figures themselves live in bench/packing.py.
    assert time.perf_counter() - start < 30.0
    assert plan.stats.useful_token_fraction >= 0.995


def test_has_targets_needs_a_trained_token_after_the_first_of_a_piece():
    tokens, offsets = flatten_documents([[5], [6], [7, 8]])
    assert has_targets(plan_packing(np.diff(offsets), seq_len=4), offsets)
    assert not has_targets(plan_packing(np.diff(offsets), seq_len=1), offsets)  # every piece is one token
    only_first_trained = np.array([True, True, True, False])  # document 2's second token is masked
    assert not has_targets(plan_packing(np.diff(offsets), seq_len=4), offsets, only_first_trained)
    # the same verdict as the labels materialise_rows builds
    plan = plan_packing(np.diff(offsets), seq_len=1)
    batch = materialise_rows(plan.rows, tokens, offsets, 1, pad_id=0)
    assert int(count_valid_targets(batch["labels"])) == 0


def test_plan_sha256_changes_with_the_rows_trained_on():
    """The data-plan fingerprint's rows_sha256: the same documents packed the same way hash equal; a held-out
    split, a mixture or max_docs that changes which documents are trained on changes it."""
    lengths = [5, 9, 3, 12, 7, 4]
    plan = plan_packing(lengths, 16, "bfd", "split", range(6))
    assert plan.sha256() == plan_packing(lengths, 16, "bfd", "split", range(6)).sha256()
    assert plan.sha256() != plan_packing(lengths, 16, "bfd", "split", [0, 1, 2, 3, 4]).sha256()
    assert plan.sha256() != plan_packing(lengths, 16, "greedy", "split", range(6)).sha256()
