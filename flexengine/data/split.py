"""Hold out whole documents for evaluation: a split by document content, never by row or token.

A document goes to the eval side when the hash of its tokens is among the smallest `eval_fraction` of all
hashes. So the split does not depend on file order, data.max_docs or the training seed, long documents are
never cut across the boundary (the split happens before packing), and exact duplicates land on the same side.
"""

from __future__ import annotations

import hashlib

import numpy as np

from flexengine.core.errors import UserError

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
