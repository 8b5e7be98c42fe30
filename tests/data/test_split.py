"""Held-out split by whole documents: deterministic, duplicates together, and no document on both sides of
the train/eval boundary through the real data path (split -> pack -> batches)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flexengine.cli.common import compose_job
from flexengine.core.errors import UserError
from flexengine.data.packing import flatten_documents
from flexengine.data.split import split_documents
from flexengine.surgery.model import load_tokenizer
from tests.helpers import job_data


def test_split_is_deterministic_sized_and_keeps_duplicates_together():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, rng.integers(5, 50)) for _ in range(200)]
    docs += [docs[3], docs[3], docs[17]]  # exact duplicates
    tokens, offsets = flatten_documents(docs)
    train, held = split_documents(tokens, offsets, 0.1)
    again_train, again_held = split_documents(tokens, offsets, 0.1)
    assert np.array_equal(train, again_train) and np.array_equal(held, again_held)
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(docs)
    assert 15 <= len(held) <= 25
    for dup in ((3, 200, 201), (17, 202)):
        assert len({d in set(held) for d in dup}) == 1  # all copies on one side
    # the split does not depend on document order
    order = rng.permutation(len(docs))
    t2, o2 = flatten_documents([docs[i] for i in order])
    _, held2 = split_documents(t2, o2, 0.1)
    assert sorted(map(tuple, (docs[order[i]].tolist() for i in held2))) == sorted(
        map(tuple, (docs[i].tolist() for i in held))
    )
    assert len(split_documents(tokens, offsets, 0.0)[1]) == 0


def test_split_refuses_to_hold_out_everything():
    tokens, offsets = flatten_documents([[1, 2, 3]] * 4)  # identical: all on one side
    with pytest.raises(UserError, match="no training document"):
        split_documents(tokens, offsets, 0.5)


def _documents_in(batch: dict) -> list[tuple]:
    """The token pieces of every document in a packed batch (padding has no target-bearing label)."""
    pieces = []
    for ids, docs, labels in zip(batch["input_ids"], batch["document_ids"], batch["labels"]):
        for d in torch.unique(docs).tolist():
            where = docs == d
            if (labels[where] != -100).any():
                pieces.append(tuple(ids[where].tolist()))
    return pieces


def test_no_document_crosses_the_train_eval_boundary(tmp_path):
    # long documents (split into several rows) and exact duplicates are the two ways a leak could happen
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    texts = [" ".join(rng.choice(words, rng.integers(20, 400))) for _ in range(60)]
    texts += texts[:5]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    job = compose_job(
        [
            "debug=fast",
            "data=jsonl",
            f"data.path={path}",
            "data.seq_len=128",
            "data.eval_fraction=0.25",
            "data.num_workers=0",
            "train.micro_batch=2",
            f"data.cache_dir={tmp_path / 'cache'}",
        ]
    )
    loader, held, report = job_data(job, load_tokenizer(job.model))
    train_docs = {seg[0] for row in loader.plan.rows for seg in row}
    eval_docs = {seg[0] for row in held.plan.rows for seg in row}
    assert train_docs.isdisjoint(eval_docs)
    assert train_docs | eval_docs == set(range(len(texts)))
    assert report["eval"]["documents"] == len(eval_docs) and report["documents"] == len(train_docs)
    assert report["eval"]["documents_split"] > 0  # some held-out documents span several rows
    # by content, through the batches both sides really serve: no text is trained on and evaluated
    corpus = loader.corpus
    content = {d: tuple(corpus.tokens[corpus.offsets[d] : corpus.offsets[d + 1]].tolist()) for d in range(len(texts))}
    assert {content[d] for d in train_docs}.isdisjoint({content[d] for d in eval_docs})
    eval_pieces = [p for b in held.batches() for p in _documents_in(b)]
    train_pieces = [p for _ in range(loader.batches_per_epoch) for p in _documents_in(loader.next_batch())]
    eval_tokens = sum(len(p) for p in eval_pieces)
    assert eval_tokens == report["eval"]["tokens"]  # every held-out token is evaluated, once
    for piece in eval_pieces:
        assert any(
            piece == content[d][s : s + len(piece)]
            for d in eval_docs
            for s in (0,) + tuple(range(128, len(content[d]), 128))
        )
    assert set(train_pieces).isdisjoint(eval_pieces)
