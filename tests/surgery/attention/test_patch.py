"""The patched model on a packed row == each document run alone through the *unpatched* HF model (eager)."""

import pytest
import torch
import torch.nn.functional as F

from flexengine import pack_documents, patch_attention
from flexengine.core.errors import UserError
from flexengine.data.packing import IGNORE_INDEX
from flexengine.surgery.applied import attention_spec
from flexengine.surgery.attention.masks import MODES
from flexengine.surgery.loss import causal_lm_loss_sum
from tests.helpers import assert_same_loss_gradients, clone_model, make_llama, make_mistral

ATOL = 1e-5


def _docs(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _assert_each_document_matches(patched, reference, docs, seq_len, mode_window=None):
    batch = pack_documents(docs, seq_len=seq_len, strategy="greedy")
    with torch.no_grad():
        packed = patched(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        for doc in docs:
            # greedy keeps order: locate the document by its tokens' row and offset
            row, start = _find(batch, doc)
            alone = reference(input_ids=torch.tensor([doc])).logits[0]
            got = packed[row, start : start + len(doc)]
            assert (got - alone).abs().max().item() <= ATOL


def _find(batch, doc):
    ids = batch["input_ids"]
    for r in range(ids.shape[0]):
        for s in range(ids.shape[1] - len(doc) + 1):
            if batch["position_ids"][r, s] == 0 and ids[r, s : s + len(doc)].tolist() == doc:
                return r, s
    raise AssertionError("document not found in packed batch")


def test_packed_doc_logits_equal_each_document_alone_with_gqa():
    reference = make_llama()
    assert reference.config.num_key_value_heads < reference.config.num_attention_heads
    patched = patch_attention(clone_model(reference), mode="packed_doc", backend="dense")
    _assert_each_document_matches(patched, reference, _docs([37, 5, 90, 1, 60]), seq_len=128)


def test_rope_scaling_model_still_matches_alone():
    reference = make_llama(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    patched = patch_attention(clone_model(reference), mode="packed_doc", backend="dense")
    _assert_each_document_matches(patched, reference, _docs([50, 20, 40]), seq_len=64)


def test_packed_doc_gradients_equal_sum_of_per_document_gradients():
    reference = make_llama()
    patched = patch_attention(clone_model(reference), mode="packed_doc", backend="dense")
    docs = _docs([30, 7, 50, 21])
    batch = pack_documents(docs, seq_len=64)
    n_valid = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    assert n_valid == sum(len(d) - 1 for d in docs)  # each document predicts its own tokens only

    out = patched.get_decoder()(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    (causal_lm_loss_sum(out.last_hidden_state, batch["labels"], patched.lm_head) / n_valid).backward()

    for doc in docs:
        ids = torch.tensor([doc])
        logits = reference(input_ids=ids).logits[0, :-1]
        (F.cross_entropy(logits, ids[0, 1:], reduction="sum") / n_valid).backward()  # same normalisation
    for (name, p), q in zip(patched.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_sliding_window_equals_hf_mistral_sliding_window():
    reference = make_mistral(sliding_window=8)
    patched = patch_attention(clone_model(reference), mode="sliding_window", window=8, backend="dense")
    ids = torch.randint(0, 256, (2, 40))  # 5x longer than the window
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        got = patched(input_ids=ids).logits
        full = patch_attention(clone_model(reference), mode="causal", backend="dense")(input_ids=ids).logits
    assert (got - want).abs().max().item() <= ATOL
    assert (full - want).abs().max().item() > 1e-3  # the window really matters on this input


def test_window_defaults_to_the_models_own_sliding_window():
    reference = make_mistral(sliding_window=6)
    patched = patch_attention(clone_model(reference), mode="sliding_window", backend="dense")
    assert attention_spec(patched).layer_windows == (6, 6)


def test_packed_sliding_equals_each_document_alone_with_window():
    reference = make_mistral(sliding_window=8)
    patched = patch_attention(clone_model(reference), mode="packed_sliding", window=8, backend="dense")
    _assert_each_document_matches(patched, reference, _docs([30, 3, 25, 12]), seq_len=80)


def test_document_ids_work_instead_of_position_ids():
    reference = make_llama()
    patched = patch_attention(clone_model(reference), mode="packed_doc", backend="dense")
    batch = pack_documents(_docs([10, 20, 5]), seq_len=40)
    with torch.no_grad():
        by_pos = patched(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        by_doc = patched(input_ids=batch["input_ids"], document_ids=batch["document_ids"]).logits
    torch.testing.assert_close(by_pos, by_doc, atol=0, rtol=0)


def test_packed_mode_without_position_or_document_ids_is_refused():
    patched = patch_attention(make_llama(), mode="packed_doc", backend="dense")
    with pytest.raises(ValueError, match="position_ids"):
        patched(input_ids=torch.zeros(1, 8, dtype=torch.long))


def _layouts(seq_len):
    return {
        "shorter_than_a_block": [3, 5, 2, 7],
        "one_document_fills_the_row": [seq_len],
        "mostly_padding": [9],
        "mixed": [100, 1, 130, 17],
    }


@pytest.mark.parametrize("mode", ["causal", "packed_doc", "sliding_window", "packed_sliding"])
def test_flex_forward_equals_dense_forward(mode):
    seq_len = 256
    reference = make_llama()
    window = 32 if MODES[mode].windowed else None
    dense = patch_attention(clone_model(reference), mode=mode, window=window, backend="dense")
    flex = patch_attention(clone_model(reference), mode=mode, window=window, backend="flex", compile=False)
    for name, lengths in _layouts(seq_len).items():
        batch = pack_documents(_docs(lengths, seed=len(lengths)), seq_len=seq_len, strategy="greedy")
        kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        with torch.no_grad():
            diff = (flex(**kwargs).logits - dense(**kwargs).logits).abs().max().item()
        assert diff <= ATOL, f"{mode}/{name}: {diff}"


@pytest.mark.slow
def test_compiled_flex_does_not_recompile_for_new_document_layouts():
    from torch._dynamo.utils import counters

    model = patch_attention(make_llama(), mode="packed_doc", backend="flex", compile=True)
    seq_len = 256
    layouts = [[256], [100, 156], [3, 3, 250], [128, 64, 32, 16, 16], [7] * 30]
    graphs = []
    with torch.no_grad():
        for i, lengths in enumerate(layouts):
            batch = pack_documents(_docs(lengths, seed=i), seq_len=seq_len, strategy="greedy")
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1
    assert graphs[1:] == [graphs[0]] * 4, f"recompiled: unique graphs per batch {graphs}"
    assert counters["recompiles"] == {} or sum(counters["recompiles"].values()) == 0


def test_sdpa_backend_leaves_hf_attention_in_place():
    model = patch_attention(make_llama(), mode="causal", backend="sdpa")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(UserError, match="sdpa"):
        patch_attention(make_llama(), mode="packed_doc", backend="sdpa")


@pytest.mark.parametrize("mode", ["causal", "packed_doc", "sliding_window", "packed_sliding"])
def test_chunked_dense_equals_one_dense_call_with_gradients(mode):
    """Skipping keys before each query chunk's first document changes nothing, forward or backward."""
    reference = make_llama()
    window = 24 if MODES[mode].windowed else None
    whole = patch_attention(clone_model(reference), mode=mode, window=window, backend="dense", dense_chunk=4096)
    chunked = patch_attention(clone_model(reference), mode=mode, window=window, backend="dense", dense_chunk=16)
    batch = pack_documents(_docs([40, 3, 70, 9, 30, 50], seed=3), seq_len=112, strategy="greedy")
    assert_same_loss_gradients(chunked, whole, batch)


def _left_padded(lengths, width, vocab=256):
    """An HF-collator batch: each row's document at the right end, padding (mask 0) before it."""
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (n, doc) in enumerate(zip(lengths, _docs(lengths, vocab))):
        ids[r, width - n :], mask[r, width - n :] = torch.tensor(doc), 1
    return ids, mask


@pytest.mark.parametrize("mode,backend", [("causal", "dense"), ("packed_doc", "dense"), ("causal", "flex")])
def test_left_padded_attention_mask_equals_hf_eager_with_the_same_mask(mode, backend):
    """attention_mask is folded into the document ids (padding its own segment), not silently ignored."""
    reference = make_llama()
    patched = patch_attention(clone_model(reference), mode=mode, backend=backend, compile=False)
    ids, mask = _left_padded([40, 17, 64], 64)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask).logits
        ignored = patched(input_ids=ids).logits if mode == "causal" else None
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() <= ATOL
    if ignored is not None:  # the old behaviour (mask dropped) differs: real tokens attended to the padding
        assert (ignored[real] - want[real]).abs().max().item() > 1e-2


def test_attention_mask_with_packed_positions_keeps_documents_apart():
    """Right padding after packed documents: each document still equals itself alone."""
    reference = make_llama()
    patched = patch_attention(clone_model(reference), mode="packed_doc", backend="dense")
    docs = _docs([10, 20])
    ids = torch.tensor([docs[0] + docs[1] + [0] * 6])
    position_ids = torch.tensor([list(range(10)) + list(range(20)) + list(range(6))])
    mask = torch.tensor([[1] * 30 + [0] * 6])
    with torch.no_grad():
        got = patched(input_ids=ids, position_ids=position_ids, attention_mask=mask).logits[0]
        for start, doc in ((0, docs[0]), (10, docs[1])):
            alone = reference(input_ids=torch.tensor([doc])).logits[0]
            assert (got[start : start + len(doc)] - alone).abs().max().item() <= ATOL


def test_attention_mask_that_would_split_a_document_or_is_not_2d_is_refused():
    patched = patch_attention(make_llama(), mode="causal", backend="dense")
    ids = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="padding inside a document"):
        patched(input_ids=ids, attention_mask=torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"\[B, S\] padding mask"):
        patched(input_ids=ids, attention_mask=torch.ones(1, 1, 8, 8))


def test_compiled_flex_is_created_by_patch_not_on_first_call(monkeypatch):
    """Creating torch.compile(flex_attention) lazily inside a compiled block costs a recompile."""
    import flexengine.surgery.attention.patch as patch_module

    monkeypatch.setattr(patch_module, "_compiled_flex", None)
    patch_attention(make_llama(), mode="packed_doc", backend="flex", compile=True)
    assert patch_module._compiled_flex is not None
