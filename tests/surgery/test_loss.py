"""Chunked cross-entropy equals the plain loss (value and gradients), skipping ignored labels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexengine.data.targets import count_valid_targets
from flexengine.surgery.loss import causal_lm_loss_sum


def _reference(hidden_BSH, labels_BS, lm_head):
    """Full [B, S, V] logits, shifted labels, ignore_index: the textbook loss (summed)."""
    logits = lm_head(hidden_BSH).float()
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels_BS[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


@pytest.mark.parametrize("chunk_size", [0, 1, 7, 64, 10_000])
def test_chunked_loss_matches_plain(chunk_size):
    torch.manual_seed(0)
    B, S, H, V = 3, 41, 16, 50
    hidden = torch.randn(B, S, H, requires_grad=True)
    lm_head = torch.nn.Linear(H, V, bias=False)
    labels = torch.randint(0, V, (B, S))
    labels[0, :10] = -100
    labels[2, 20] = -100
    ref = _reference(hidden, labels, lm_head)
    ref_grads = torch.autograd.grad(ref, (hidden, lm_head.weight))
    out = causal_lm_loss_sum(hidden, labels, lm_head, chunk_size)
    grads = torch.autograd.grad(out, (hidden, lm_head.weight))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert int(count_valid_targets(labels)) == B * (S - 1) - 10  # labels[0, 0] is never a target


def test_all_ignored_gives_zero_and_zero_grad():
    hidden = torch.randn(1, 8, 4, requires_grad=True)
    lm_head = torch.nn.Linear(4, 10, bias=False)
    labels = torch.full((1, 8), -100)
    out = causal_lm_loss_sum(hidden, labels, lm_head, chunk_size=3)
    out.backward()
    assert out.item() == 0.0 and hidden.grad.abs().sum() == 0


def test_chunked_loss_never_materialises_all_logits():
    """Peak logits bytes alive for backward: chunked keeps none, plain keeps [tokens, vocab] fp32 log-probs."""
    from flexengine.surgery.memory.meter import _AliveOutputs

    torch.manual_seed(0)
    hidden = torch.randn(1, 513, 32, requires_grad=True)
    lm_head = torch.nn.Linear(32, 4096, bias=False)
    labels = torch.randint(0, 4096, (1, 513))
    alive = {}
    for chunk in (0, 64):
        mode = _AliveOutputs()
        with mode:
            out = causal_lm_loss_sum(hidden, labels, lm_head, chunk)
        alive[chunk] = sum(n for ref, n, _, _ in mode.records.values() if not ref.expired())
        del out
    assert alive[0] >= 512 * 4096 * 4
    assert alive[64] < 512 * 4096 * 4 / 50


def test_host_computed_positions_give_the_same_loss():
    """The loader precomputes which positions predict a valid target; the loss must not change."""
    from flexengine.data.targets import predicting_positions
    from flexengine.surgery.loss import causal_lm_loss_sum

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 8, generator=g)
    labels = torch.randint(0, 16, (2, 12), generator=g)
    labels[0, 3] = labels[1, 0] = labels[1, 7:] = -100
    head = torch.nn.Linear(8, 16, bias=False)
    index = predicting_positions(labels)
    assert len(index) == int((labels[:, 1:] != -100).sum())
    plain = torch.nn.functional.cross_entropy(
        head(hidden[:, :-1]).reshape(-1, 16), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    for chunk in (0, 5):
        torch.testing.assert_close(causal_lm_loss_sum(hidden, labels, head, chunk, index), plain)


@pytest.mark.slow
def test_chunked_loss_bounds_memory_at_128k_tokens():
    """131,072 tokens, vocab 4096: whole fp32 logits would be 2 GiB (and their gradient as much again); chunks of
    1024 keep the working set at the planner's estimate (hidden rows + one chunk's log-probs and gradients, the
    chunks' summed weight and input gradients: loss_moments), and the value equals plain CE summed over slices."""
    from flexengine.planning.activations import constant_bytes, loss_transient_bytes
    from flexengine.planning.shapes import ModelShape, Workload
    from flexengine.surgery.attention.spec import AttnBackend
    from flexengine.surgery.memory.meter import measure_peak_bytes

    torch.manual_seed(0)
    S, H, V, chunk = 131_072, 16, 4096, 1024
    hidden = torch.randn(1, S, H, requires_grad=True)
    lm_head = torch.nn.Linear(H, V, bias=False)
    labels = torch.randint(0, V, (1, S))
    out = {}
    peak = measure_peak_bytes(
        lambda: out.update(loss=causal_lm_loss_sum(hidden, labels, lm_head, chunk)) or out["loss"].backward()
    )
    shape = ModelShape(hidden=H, heads=1, kv_heads=1, head_dim=H, intermediate=H, layers=0, vocab=V, params=0)
    w = Workload(1, S, 4, AttnBackend.FLEX, chunk)
    planned = constant_bytes(shape, w, False)["loss_inputs"] + loss_transient_bytes(shape, w)
    # the .grad of hidden and lm_head, which backward leaves (the chunks' sums before them are in the transient)
    planned += S * H * 4 + V * H * 4
    assert "log_probs" not in constant_bytes(shape, w, False)  # chunked: no whole-sequence log-probs
    assert peak < 4 * S * V / 8  # an eighth of the whole logits, for scale
    assert peak == pytest.approx(planned, rel=0.05)
    with torch.no_grad():
        ends = [(i, min(i + 8192, S - 1)) for i in range(0, S - 1, 8192)]
        want = sum(
            F.cross_entropy(lm_head(hidden[0, i:j]).float(), labels[0, i + 1 : j + 1], reduction="sum") for i, j in ends
        )
    torch.testing.assert_close(out["loss"].detach(), want, rtol=1e-5, atol=1e-2)
