"""The varlen backend (per-document SDPA calls) == the dense reference, forward and backward."""

import pytest
import torch

from flexengine.surgery.attention.block_mask import build_batch_mask
from flexengine.surgery.attention.mask_mode import mask_mode
from flexengine.surgery.attention.masks import MODES
from flexengine.surgery.attention.patch import LayerMasks, flexengine_attention
from flexengine.surgery.attention.spec import AttentionSpec, AttnBackend
from flexengine.surgery.attention.varlen import band_chunk, build_varlen_plan, document_runs


def _random_row(seq_len: int, g: torch.Generator) -> torch.Tensor:
    """Document ids of one packed row: 1-token documents, documents across chunk/window boundaries, a tail."""
    lengths, total = [], 0
    while total < seq_len:
        kind = int(torch.randint(0, 4, (1,), generator=g))
        n = [1, int(torch.randint(2, 20, (1,), generator=g)), int(torch.randint(60, 200, (1,), generator=g)), seq_len][
            kind
        ]
        n = min(n, seq_len - total)
        lengths.append(n)
        total += n
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def layer_masks(mode: str, backend: str, doc, window=None, dense_chunk=512) -> LayerMasks:
    """One batch's masks for a single-layer model attending as `mode` on `backend`."""
    window = window if MODES[mode].windowed else None
    mask = build_batch_mask(
        doc, mode=mask_mode(mode, window), backend=AttnBackend(backend), block_size=16, dense_chunk=dense_chunk
    )
    spec = AttentionSpec(mode, AttnBackend(backend), (window,), (None,), "test")
    return LayerMasks(spec, {None: mask})


def _attend(backend, mode, doc, q, k, v, window, dense_chunk=64):
    masks = layer_masks(mode, backend, doc, window, dense_chunk)
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = flexengine_attention(None, qq, kk, vv, None, scaling=0.3, flexengine_mask=masks)
    return out, qq, kk, vv


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [5, 48])
def test_varlen_equals_dense_forward_and_backward(mode, window):
    g = torch.Generator().manual_seed(hash((mode, window)) % 2**31)
    B, Hq, Hkv, S, D = 3, 4, 2, 300, 8
    doc = torch.stack([_random_row(S, g) for _ in range(B - 1)] + [torch.zeros(S, dtype=torch.long)])
    q = torch.randn(B, Hq, S, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    grad = torch.randn(B, S, Hq, D, generator=g)
    ref = _attend("dense", mode, doc, q, k, v, window)
    got = _attend("varlen", mode, doc, q, k, v, window)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    ref[0].backward(grad)
    got[0].backward(grad)
    for name, a, b in zip("qkv", got[1:], ref[1:]):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=f"d{name}")


def test_bf16_matches_dense():
    g = torch.Generator().manual_seed(0)
    doc = torch.stack([_random_row(256, g) for _ in range(2)])
    q, k, v = (torch.randn(2, 4, 256, 16, generator=g).bfloat16() for _ in range(3))
    for mode in ("packed_doc", "packed_sliding"):
        ref, got = _attend("dense", mode, doc, q, k, v, 40)[0], _attend("varlen", mode, doc, q, k, v, 40)[0]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_under_autocast_mixed_dtypes_compute_like_dense():
    """bf16 autocast hands fp32 q/k (HF's rotary embedding) next to a bf16 v: varlen computes in the autocast dtype,
    as the dense backend's SDPA does, with gradients back in each input's dtype."""
    g = torch.Generator().manual_seed(1)
    doc = torch.stack([_random_row(256, g) for _ in range(2)])
    q, k = torch.randn(2, 4, 256, 16, generator=g), torch.randn(2, 2, 256, 16, generator=g)
    v = torch.randn(2, 2, 256, 16, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _attend("dense", "packed_doc", doc, q, k, v, None)
        got = _attend("varlen", "packed_doc", doc, q, k, v, None)
    assert got[0].dtype == ref[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)
    got[0].float().sum().backward()
    assert [t.grad.dtype for t in got[1:]] == [torch.float32, torch.float32, torch.bfloat16]


def test_plan_covers_every_query_once_and_batches_equal_documents():
    doc = torch.tensor([[0] * 10 + [1] * 3 + [2] * 3, [0] * 3 + [1] * 13, [0] * 16])
    runs = document_runs(doc)
    assert runs == [[(0, 10), (10, 3), (13, 3)], [(0, 3), (3, 13)], [(0, 16)]]
    plan = build_varlen_plan(runs, window=None)
    covered = torch.zeros(3, 16, dtype=torch.int)
    for _, row, start, length in plan.tolist():
        covered[row, start : start + length] += 1
    assert (covered == 1).all()
    assert len({length for *_, length in plan.tolist()}) == 4  # the three 3-token documents share one call


def test_windowed_plan_skips_keys_outside_the_window():
    window = 256
    c = band_chunk(window)
    plan = build_varlen_plan([[(0, 1000)]], window=window)
    kinds = plan[:, 0].tolist()
    assert kinds.count(0) == 1 and plan[0].tolist() == [0, 0, 0, window]  # causal prefix, then chunks
    assert plan[1:, 3].max() == c and plan[:, 3].sum() == 1000
    # keys read by all calls: prefix window^2/2-ish plus chunk * (chunk + window - 1) each: O(S * window), not S^2
    keys_read = window * window + sum(n * (n + window - 1) for n in plan[1:, 3].tolist())
    assert keys_read < 1000 * (window + c)


def test_varlen_refuses_dropout():
    doc = torch.zeros(1, 8, dtype=torch.long)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(NotImplementedError, match="dropout"):
        flexengine_attention(None, q, q, q, None, dropout=0.1, flexengine_mask=layer_masks("packed_doc", "varlen", doc))


@pytest.mark.parametrize("mode", ["packed_doc", "packed_sliding"])
def test_patched_model_varlen_equals_dense_with_gradients(mode):
    from flexengine import pack_documents, patch_attention
    from tests.helpers import assert_same_loss_gradients, clone_model, make_llama

    reference = make_llama()
    window = 24 if mode == "packed_sliding" else None
    dense = patch_attention(clone_model(reference), mode=mode, window=window, backend="dense", dense_chunk=16)
    varlen = patch_attention(clone_model(reference), mode=mode, window=window, backend="varlen")
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 1, 70, 9, 130, 1, 50)]
    batch = pack_documents(docs, seq_len=160, strategy="greedy")
    assert_same_loss_gradients(varlen, dense, batch)


def test_compiled_varlen_takes_new_layouts_without_recompiling():
    from torch._dynamo.utils import counters

    from flexengine.surgery.attention.varlen import varlen_attention

    torch._dynamo.reset()
    counters.clear()
    attend = torch.compile(varlen_attention, backend="aot_eager", fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 96, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 96, 8, generator=g, requires_grad=True)
    for layout in ([96], [40, 56], [1, 1, 94], [30, 30, 36]):
        doc = torch.repeat_interleave(torch.arange(len(layout)), torch.tensor(layout)).expand(2, 96)
        out = attend(q, k, k, doc, 16, None)
        out.sum().backward()
        eager = varlen_attention(q.detach(), k.detach(), k.detach(), doc, 16, None)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])
