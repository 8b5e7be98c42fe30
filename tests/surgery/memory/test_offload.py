"""Activation offload's copy/event/wait order, on CPU with a recording fake of the CUDA stream calls, and its
bound on pinned host memory."""

from __future__ import annotations

import contextlib
import gc

import torch

from flexengine.core.config import MemoryConfig
from flexengine.surgery.applied import applied
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy
from tests.helpers import clone_model, make_llama

LAYERS, B, S = 4, 1, 64


class FakeStreams:
    """Stands in for offload.CudaStreams: CPU copies, and a log of events recorded and waited on.

    An event is (kind, block): kind "offloaded" (device -> host done) or "prefetched" (host -> device done).
    There is no way to wait on the whole side stream: code that tried would fail here."""

    def __init__(self):
        self.log: list[tuple] = []
        self.block, self.kind = None, "offloaded"

    def on_side(self):
        return contextlib.nullcontext()

    def side_waits_for_compute(self) -> None:
        self.log.append(("side_waits_for_compute", self.block))

    def record(self):
        event = (self.kind, self.block)
        self.log.append(("record", event))
        return event

    def compute_waits(self, event) -> None:
        self.log.append(("wait", event))

    def used_on_side(self, t) -> None:
        pass

    def used_on_compute(self, t) -> None:
        pass

    def host_buffer(self, t, pinned: bool):
        self.log.append(("alloc", pinned, t.numel() * t.element_size()))
        return torch.empty_like(t)


def _offloaded_model(max_pinned_bytes: int = 2**40):
    base = make_llama(num_hidden_layers=LAYERS)
    model = clone_model(base)
    patch_attention(model, mode="packed_doc", backend="dense")
    apply_memory_policy(model, MemoryConfig(policy="offload"))
    manager = applied(model).offload
    fake = FakeStreams()
    manager._streams, manager.max_pinned_bytes = fake, max_pinned_bytes
    block, prefetch = manager.block, manager._prefetch

    @contextlib.contextmanager
    def labelled_block(index, kwargs):  # the fake labels the events with the block they belong to
        fake.block, fake.kind = index, "offloaded"
        with block(index, kwargs):
            yield

    def labelled_prefetch(group):
        fake.block, fake.kind = group.index, "prefetched"
        prefetch(group)

    manager.block, manager._prefetch = labelled_block, labelled_prefetch
    return base, model.train(), manager, fake


def _batch():
    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(S)[None]}


def test_backward_waits_per_handle_and_prefetch_runs_ahead():
    base, model, _, fake = _offloaded_model()
    batch = _batch()
    forward_loss_sum(model, batch).backward()
    log = fake.log
    waits = [e for op, e in (x[:2] for x in log) if op == "wait"]
    # the last block comes back on demand, every other one was prefetched; blocks in backward order
    assert [b for _, b in waits] == sorted((b for _, b in waits), reverse=True)
    assert {k for k, b in waits if b == LAYERS - 1} == {"offloaded"}
    assert {k for k, b in waits if b < LAYERS - 1} == {"prefetched"}
    for i in range(LAYERS - 1):
        first_wait_next = next(n for n, x in enumerate(log) if x[0] == "wait" and x[1][1] == i + 1)
        prefetches = [n for n, x in enumerate(log) if x[0] == "record" and x[1] == ("prefetched", i)]
        waits_i = [n for n, x in enumerate(log) if x[0] == "wait" and x[1][1] == i]
        # block i's copies are queued before block i+1's backward waits on anything, so they overlap it,
        # and nothing of block i is waited on until block i+1's tensors have all been fetched
        assert prefetches and max(prefetches) < first_wait_next
        last_wait_next = max(n for n, x in enumerate(log) if x[0] == "wait" and x[1][1] == i + 1)
        assert min(waits_i) > last_wait_next
    # each handle's device -> host copy starts after the compute that wrote it
    for n, x in enumerate(log):
        if x[0] == "alloc":
            assert log[n + 1][0] == "side_waits_for_compute"
    # gradients are those of the model without offload
    plain = clone_model(base)
    patch_attention(plain, mode="packed_doc", backend="dense")
    forward_loss_sum(plain.train(), batch).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_pinned_host_memory_is_bounded_and_released():
    _, model, _, fake = _offloaded_model()
    forward_loss_sum(model, _batch()).backward()
    sizes = [x[2] for x in fake.log if x[0] == "alloc"]
    bound = sum(sizes) // 2
    _, model, manager, fake = _offloaded_model(max_pinned_bytes=bound)
    loss = forward_loss_sum(model, _batch())
    allocs = [x for x in fake.log if x[0] == "alloc"]
    pinned = [x for x in allocs if x[1]]
    assert pinned and len(pinned) < len(allocs)  # the first ones pinned, then pageable
    assert sum(x[2] for x in pinned) <= bound == manager.max_pinned_bytes
    assert manager.pageable_bytes == sum(x[2] for x in allocs if not x[1])
    loss.backward()
    del loss
    gc.collect()
    assert manager.pinned_bytes == 0  # released with the handles after backward
