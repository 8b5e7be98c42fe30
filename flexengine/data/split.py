"""Hold out whole documents for evaluation: a split by document content, never by row or token.

A document goes to the eval side when the hash of its tokens is among the smallest `eval_fraction` of all
hashes. So the split does not depend on file order, data.max_docs or the training seed, long documents are
never cut across the boundary (the split happens before packing), and exact duplicates land on the same side.
A separate held-out set (data.eval_path) is read like data.path, and its documents that are also training
documents are dropped, kept or refused by data.eval_overlap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import numpy as np

from flexengine.core.config import DataConfig
from flexengine.core.errors import UserError
from flexengine.data.corpus import Corpus
from flexengine.data.sources import resolve_eval_split

log = logging.getLogger(__name__)

_SALT = b"flexengine-heldout-v1"


def document_hashes(tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """A uint64 hash of each document's token ids (offsets[i]:offsets[i+1])."""
    out = np.empty(len(offsets) - 1, dtype=np.uint64)
    for i in range(len(out)):
        digest = hashlib.blake2b(
            np.ascontiguousarray(tokens[offsets[i] : offsets[i + 1]]).tobytes(), digest_size=8, key=_SALT
        ).digest()
        out[i] = int.from_bytes(digest, "little")
    return out


def split_documents(tokens: np.ndarray, offsets: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document indices, each sorted; eval_fraction 0 -> (all, none)."""
    n = len(offsets) - 1
    if eval_fraction <= 0:
        return np.arange(n), np.zeros(0, dtype=np.int64)
    hashes = document_hashes(tokens, offsets)
    n_eval = max(1, round(n * eval_fraction))
    threshold = np.sort(hashes)[n_eval - 1]
    is_eval = hashes <= threshold  # ties (duplicates) at the threshold all go to eval
    if is_eval.all():
        raise UserError(
            f"data.eval_fraction={eval_fraction} leaves no training document out of {n} "
            "(identical documents stay together): lower it or add documents."
        )
    return np.flatnonzero(~is_eval), np.flatnonzero(is_eval)


def shared_documents(
    train: tuple[np.ndarray, np.ndarray], train_docs: np.ndarray, held_out: tuple[np.ndarray, np.ndarray]
) -> np.ndarray:
    """Indices of the held-out documents whose tokens equal a training document's. train and held_out are
    (tokens, offsets) of two corpora; train_docs the training documents among the first."""
    train_hashes = document_hashes(*train)[np.asarray(train_docs, dtype=np.int64)]
    return np.flatnonzero(np.isin(document_hashes(*held_out), train_hashes))


def eval_source(data: DataConfig) -> DataConfig:
    """data.eval_path read like data.path (same source, format and fields), all of its documents; of a saved
    DatasetDict its held-out split (data.eval_split, else validation, else test), never data.hf_split."""
    split = resolve_eval_split(data)
    return dataclasses.replace(
        data,
        path=data.eval_path,
        hf_split=split or data.hf_split,
        eval_path=None,
        eval_split=None,
        max_docs=None,
        mix=[],
    )


def describe_eval_source(data: DataConfig) -> str:
    """Where the held-out documents come from, for the log and summary.json."""
    split = resolve_eval_split(data)
    if split is None:
        return str(data.eval_path)
    how = "data.eval_split" if data.eval_split else "data.eval_split default: validation, else test"
    return f"{data.eval_path}, split {split!r} ({how})"


# data.eval_overlap=auto drops shared documents up to this share of the eval set: standard held-out splits share
# a few short token-identical records (wikitext repeats heading lines such as " = = Reception = = "), while more
# than that means the eval set largely is training data (the wrong split, or data.path given twice)
EVAL_OVERLAP_DROP_MAX = 0.01


def held_out_without_overlap(
    corpus: Corpus, train_docs: np.ndarray, eval_corpus: Corpus, data: DataConfig
) -> np.ndarray:
    """The data.eval_path documents to evaluate on, by data.eval_overlap: those that are also training documents
    would let the eval loss pick the best checkpoint and stop early on training data."""
    everything = np.arange(len(eval_corpus))
    shared = shared_documents((corpus.tokens, corpus.offsets), train_docs, (eval_corpus.tokens, eval_corpus.offsets))
    if not len(shared):
        return everything
    what = (
        f"data.eval_path ({describe_eval_source(data)}): {len(shared)} of its {len(eval_corpus)} documents are also "
        f"training documents (identical tokens; held-out document indices {shared[:5].tolist()}"
        f"{' ...' if len(shared) > 5 else ''})"
    )
    if data.eval_overlap == "allow":
        log.warning("%s; kept (data.eval_overlap=allow): the eval loss partly measures training data", what)
        return everything
    few = len(shared) <= EVAL_OVERLAP_DROP_MAX * len(eval_corpus)
    if data.eval_overlap == "drop" or (data.eval_overlap == "auto" and few):
        kept = np.setdiff1d(everything, shared)
        if not len(kept):
            raise UserError(f"{what}: every held-out document is a training document; nothing is left to evaluate.")
        log.warning("%s; dropped from the eval set (data.eval_overlap=%s), %d left", what, data.eval_overlap, len(kept))
        return kept
    limit = (
        f"more than data.eval_overlap=auto drops by itself ({EVAL_OVERLAP_DROP_MAX:.0%} of them)"
        if data.eval_overlap == "auto"
        else "and data.eval_overlap=refuse"
    )
    raise UserError(
        f"{what}, {limit}, so the eval loss, best checkpoint and early stopping would measure training data. "
        "Evaluate on a split the training set does not contain (data.eval_split), hold out part of data.path with "
        "data.eval_fraction instead, or set data.eval_overlap=drop (evaluate on the rest) or data.eval_overlap=allow "
        "(keep them)."
    )
