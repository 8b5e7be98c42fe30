"""The flex BlockMask and the dense reference mask describe the same attention pattern."""

import pytest
import torch

from flexengine.surgery.attention.block_mask import DenseMask, FlexMask, VarlenMask, build_batch_mask
from flexengine.surgery.attention.mask_mode import mask_mode
from flexengine.surgery.attention.spec import AttnBackend


def _mask(doc, mode, backend, window=100, block_size=128):
    return build_batch_mask(doc, mode=mask_mode(mode, window), backend=AttnBackend(backend), block_size=block_size)


def _layout(seq_len, lengths):
    doc = torch.full((seq_len,), len(lengths), dtype=torch.long)
    at = 0
    for i, n in enumerate(lengths):
        doc[at : at + n] = i
        at += n
    return doc


@pytest.mark.parametrize("mode", ["causal", "packed_doc", "sliding_window", "packed_sliding"])
def test_flex_and_dense_count_the_same_blocks(mode):
    seq_len, block = 512, 128
    doc = torch.stack([_layout(seq_len, [3, 200, 40, 150]), _layout(seq_len, [512]), _layout(seq_len, [30])])
    dense = _mask(doc, mode, "dense", block_size=block)
    flex = _mask(doc, mode, "flex", block_size=block)
    assert int(dense.computed_blocks) == int(flex.computed_blocks)
    assert dense.causal_blocks == flex.causal_blocks == 3 * 4 * 5 // 2


def test_block_density_drops_with_many_short_documents():
    seq_len = 1024
    one_doc = _mask(_layout(seq_len, [seq_len])[None], "packed_doc", "dense")
    many = _mask(_layout(seq_len, [128] * 8)[None], "packed_doc", "dense")
    assert float(one_doc.block_density) == 1.0
    assert float(many.block_density) == pytest.approx(8 / 36)  # 8 diagonal blocks of 36 causal ones


@pytest.mark.parametrize("mode", ["causal", "packed_doc", "sliding_window", "packed_sliding"])
def test_block_level_builder_equals_torch_create_block_mask(mode):
    from flexengine.surgery.attention.block_mask import _create_block_mask, build_block_mask, canonical_document_ids

    g = torch.Generator().manual_seed(1)
    seq_len, block = 1024, 128
    rows = []
    for _ in range(3):
        lengths, total = [], 0
        while total < seq_len:
            n = min(int(torch.randint(1, 400, (1,), generator=g)), seq_len - total)
            lengths.append(n)
            total += n
        rows.append(_layout(seq_len, lengths))
    doc = canonical_document_ids(torch.stack(rows))
    m = mask_mode(mode, 200)
    ours = build_block_mask(m, doc, block)
    torch_built = _create_block_mask(m.mask_mod(doc), 3, seq_len, doc.device, block)
    assert torch.equal(ours.to_dense(), torch_built.to_dense())
    # "full" blocks skip the mask_mod: they must be exactly torch's (a wrong full block would leak attention)
    assert torch.equal(ours.full_kv_num_blocks, torch_built.full_kv_num_blocks)


@pytest.mark.parametrize(
    ("backend", "kind", "form"),
    [("flex", FlexMask, "block_mask"), ("dense", DenseMask, "dense_chunks"), ("varlen", VarlenMask, "varlen_ids")],
)
def test_each_backend_gets_a_mask_of_its_own_type_holding_only_its_form(backend, kind, form):
    doc = _layout(256, [100, 156])[None]
    mask = _mask(doc, "packed_doc", backend)
    assert type(mask) is kind and getattr(mask, form) is not None
    others = {"block_mask", "dense_chunks", "varlen_ids"} - {form}
    assert not any(hasattr(mask, f) for f in others)  # no optional field of another backend to leave None


def test_dense_counts_its_chunks_and_flex_its_blocks():
    doc = _layout(256, [100, 156])[None]
    dense = _mask(doc, "packed_doc", "dense")
    # one 512-query chunk covers the 256-token row; its keys run from the first document start to the last query
    assert dense.executed_pairs == 1 * 256 * 256
    flex = _mask(doc, "packed_doc", "flex", block_size=128)
    # query block 0 sees key block 0; query block 1 (document 1 began at token 100) sees key blocks 0 and 1
    assert int(flex.executed_pairs) == 3 * 128 * 128
