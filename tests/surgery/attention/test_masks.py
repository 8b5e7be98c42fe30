"""Mask functions against brute-force definitions, and the position-id <-> document-id conversions."""

import torch

from flexengine.surgery.attention.block_mask import dense_mask_from_mod
from flexengine.surgery.attention.mask_mode import mask_mode
from flexengine.surgery.attention.masks import (
    document_ids_from_position_ids,
    position_ids_from_document_ids,
)


def _brute_force(mode, doc, window):
    S = doc.shape[0]
    out = torch.zeros(S, S, dtype=torch.bool)
    for q in range(S):
        for k in range(S):
            ok = k <= q
            if mode in ("packed_doc", "packed_sliding"):
                ok = ok and bool(doc[q] == doc[k])
            if mode in ("sliding_window", "packed_sliding"):
                ok = ok and (q - k < window)  # HF: kv_idx > q_idx - sliding_window
            out[q, k] = ok
    return out


def test_every_mode_matches_brute_force_definition():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3]])
    for mode in ("causal", "packed_doc", "sliding_window", "packed_sliding"):
        mod = mask_mode(mode, 3).mask_mod(doc)
        dense = dense_mask_from_mod(mod, 1, range(doc.shape[1]), range(doc.shape[1]), doc.device)[0, 0]
        assert torch.equal(dense, _brute_force(mode, doc[0], 3)), mode


def test_document_ids_come_from_position_restarts_not_token_values():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert document_ids_from_position_ids(position_ids).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4, 4, 4]]


def test_position_ids_restart_per_document_and_round_trip():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3], [5, 5, 5, 5, 5, 5, 6, 6]])
    pos = position_ids_from_document_ids(doc)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1]]
    again = document_ids_from_position_ids(pos)
    # same partition into documents (ids may be renumbered)
    assert torch.equal(again[:, 1:] != again[:, :-1], doc[:, 1:] != doc[:, :-1])


def test_mask_mods_have_descriptive_names():
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert mask_mode("packed_sliding", 2).mask_mod(ids).__name__ == "document_sliding_window_2"
    assert mask_mode("sliding_window", None).mask_mod(ids).__name__ == "causal"  # a layer without a window
