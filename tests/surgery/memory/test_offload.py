"""Activation offload's copy/event/wait order, on CPU with a recording fake of the CUDA stream calls: the stream its
device buffers come from, the bound on blocks in flight, the waits that make freeing safe, and its bound on
pinned host memory."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from flexengine.core.config import MemoryConfig
from flexengine.surgery.applied import applied
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs
from flexengine.surgery.memory.offload import OFFLOAD_BLOCKS_IN_FLIGHT, OffloadManager, pinned_block_bytes
from tests.helpers import clone_model, make_llama

LAYERS, B, S = 4, 1, 64
N = OFFLOAD_BLOCKS_IN_FLIGHT


class FakeStreams:
    """Stands in for offload.CudaStreams: CPU copies, and a log of events recorded and waited on, of the stream
    each device buffer is allocated on, and of the blocks holding device memory at every call.

    An event is (kind, block): kind "offloaded" (device -> host done) or "prefetched" (host -> device done).
    There is no way to wait on the whole side stream, nor `record_stream`: code that tried would fail here.
    Nothing here ever reports a copy finished, so a copy runs until compute waits on its event: copies slower than
    compute by any factor. What a block holds on the device for offload: the tensors offload passes in to copy to
    host (the saved storages, which it keeps until it lets go of them) and the buffers it allocates, for as long as
    they are alive. (A storage can outlive offload's hold -- the model keeps its embeddings output, block 0's input,
    through the whole forward -- so the tensors, not their storages, are tracked.)"""

    def __init__(self):
        self.log: list[tuple] = []
        self.block, self.kind = None, "offloaded"
        self.side_depth = 0  # > 0 inside on_side()
        self.device: list[tuple[str, int, weakref.ref]] = []  # (what, block, tensor): "saved" or "buffer"
        self.in_flight: dict[str, int] = {"forward": 0, "backward": 0}  # most blocks holding device memory
        self.phase = "forward"

    def holding(self, what: str = "") -> set:
        """Blocks with a live device storage (of kind `what`, or any)."""
        return {b for w, b, ref in self.device if ref() is not None and what in ("", w)}

    def _sample(self) -> None:
        self.in_flight[self.phase] = max(self.in_flight[self.phase], len(self.holding()))

    @contextlib.contextmanager
    def on_side(self):
        self.side_depth += 1
        try:
            yield
        finally:
            self.side_depth -= 1

    def side_waits_for_compute(self) -> None:
        self.log.append(("side_waits_for_compute", self.block))
        self._sample()

    def record(self):
        event = (self.kind, self.block)
        self.log.append(("record", event))
        self._sample()
        return event

    def compute_waits(self, event) -> None:
        guarded = self.holding("saved" if event[0] == "offloaded" else "buffer")
        self.log.append(("wait", event, event[1] in guarded))  # whether what the copy touched is still alive
        self._sample()

    def host_buffer(self, t, pinned: bool):
        self.device.append(("saved", self.block, weakref.ref(t)))
        self.log.append(("alloc", pinned, t.numel() * t.element_size()))
        self._sample()
        return torch.empty_like(t)

    def device_buffer(self, host, device):
        buffer = torch.empty_like(host, device=device)
        self.device.append(("buffer", self.block, weakref.ref(buffer)))
        self.log.append(("device_buffer", self.side_depth > 0, self.block))
        self._sample()
        return buffer


def _offloaded_model(max_pinned_bytes: int = 2**40, blocks_in_flight: int = N):
    base = make_llama(num_hidden_layers=LAYERS)
    model = clone_model(base)
    patch_attention(model, mode="packed_doc", backend="dense")
    apply_memory_policy(model, block_memory_specs(MemoryConfig(policy="offload"), model.config.num_hidden_layers))
    manager = applied(model).offload
    fake = FakeStreams()
    manager._streams, manager.max_pinned_bytes, manager.blocks_in_flight = fake, max_pinned_bytes, blocks_in_flight
    block, prefetch, fetch = manager.block, manager._prefetch, manager._fetch

    @contextlib.contextmanager
    def labelled_block(index, kwargs):  # the fake labels the events with the block they belong to
        fake.block, fake.kind = index, "offloaded"
        with block(index, kwargs):
            yield

    def labelled_prefetch(group):
        fake.block, fake.kind = group.index, "prefetched"
        prefetch(group)

    def logged_fetch(handle):
        fake.log.append(("fetch", handle.group.index))
        return fetch(handle)

    manager.block, manager._prefetch, manager._fetch = labelled_block, labelled_prefetch, logged_fetch
    return base, model.train(), manager, fake


def _batch():
    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(S)[None]}


def _backward(model, fake) -> list[tuple]:
    """Forward and backward; the log entries of the backward."""
    loss = forward_loss_sum(model, _batch())
    fake.phase, start = "backward", len(fake.log)
    loss.backward()
    return fake.log[start:]


def _where(log: list[tuple], match) -> list[int]:
    return [n for n, x in enumerate(log) if match(x)]


def test_backward_waits_per_handle_and_prefetch_runs_ahead():
    base, model, _, fake = _offloaded_model()
    log = _backward(model, fake)
    in_place = range(LAYERS - N, LAYERS)  # the forward's last N blocks still hold their saved tensors
    prefetched = [b for b in range(LAYERS) if b not in in_place]
    waits = [x[1] for x in log if x[0] == "wait"]
    assert {b for kind, b in waits if kind == "prefetched"} == set(prefetched)
    assert {b for kind, b in waits if kind == "offloaded"} == set(in_place)  # before their memory goes back
    assert not [x for x in log if x[0] == "device_buffer" and x[2] in in_place]  # used in place, not copied back
    for i in prefetched:
        records = _where(log, lambda x, i=i: x[:2] == ("record", ("prefetched", i)))
        fetches_next = _where(log, lambda x, i=i: x == ("fetch", i + 1))
        waits_i = _where(log, lambda x, i=i: x[0] == "wait" and x[1] == ("prefetched", i))
        # block i's copies are queued before block i+1's backward takes its first tensor, so they overlap it,
        # and nothing of block i is waited on until block i+1's tensors have all been taken
        assert records and max(records) < min(fetches_next)
        assert min(waits_i) > max(fetches_next)
    # gradients are those of the model without offload
    plain = clone_model(base)
    patch_attention(plain, mode="packed_doc", backend="dense")
    forward_loss_sum(plain.train(), _batch()).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_prefetch_buffers_come_from_the_compute_stream():
    """Allocated outside the side stream (its pool is not the compute stream's), and the side stream starts its
    copies after the compute queued so far, which may still be using the memory the allocator handed out."""
    _, model, _, fake = _offloaded_model()
    log = _backward(model, fake)
    buffers = [x for x in log if x[0] == "device_buffer"]
    assert buffers and not any(on_side for _, on_side, _ in buffers)
    for block in {b for _, _, b in buffers}:
        allocated = max(_where(log, lambda x, b=block: x[0] == "device_buffer" and x[2] == b))
        first_copy = min(_where(log, lambda x, b=block: x[:2] == ("record", ("prefetched", b))))
        side_waits = _where(log, lambda x, b=block: x == ("side_waits_for_compute", b))
        assert any(allocated < n < first_copy for n in side_waits), block


@pytest.mark.parametrize("blocks_in_flight", [N, N + 1])
def test_blocks_in_flight_are_bounded_in_forward_and_backward(blocks_in_flight):
    """Copies never finish here unless compute waits on them: still, at most `blocks_in_flight` blocks hold device
    memory, and the bound is reached (it is what limits them). Before block i packs anything, compute waits on block
    i - N's last device -> host copy, after block i - 1 queued its own."""
    _, model, _, fake = _offloaded_model(blocks_in_flight=blocks_in_flight)
    forward_start = len(fake.log)
    _backward(model, fake)
    assert fake.in_flight["forward"] == blocks_in_flight
    assert 2 <= fake.in_flight["backward"] <= blocks_in_flight
    log = fake.log[forward_start:]
    first_copy = {b: min(_where(log, lambda x, b=b: x[:2] == ("record", ("offloaded", b)))) for b in range(LAYERS)}
    last_copy = {b: max(_where(log, lambda x, b=b: x[:2] == ("record", ("offloaded", b)))) for b in range(LAYERS)}
    for i in range(blocks_in_flight, LAYERS):
        bound = _where(log, lambda x, i=i: x[:2] == ("wait", ("offloaded", i - blocks_in_flight)))
        assert bound and last_copy[i - 1] < bound[0] < first_copy[i], i
    waits = [x for x in fake.log if x[0] == "wait"]
    assert all(alive for _, _, alive in waits)  # each wait comes before the memory its copy touched is freed


def test_dropped_graph_waits_on_copies_before_their_memory_is_freed():
    """A forward whose graph is dropped (a backward that raised) after a prefetch started: the held saved tensors
    and the prefetched buffers nobody waited on are freed only after compute waits on their copies."""
    _, model, manager, fake = _offloaded_model()
    loss = forward_loss_sum(model, _batch())
    released = manager._last().prev.prev  # block LAYERS - 3: its saved tensors went back in forward
    manager._prefetch(released)
    start = len(fake.log)
    del loss, released
    gc.collect()
    waits = [x for x in fake.log[start:] if x[0] == "wait"]
    assert {event for _, event, _ in waits} == {
        ("prefetched", LAYERS - 3),
        *(("offloaded", b) for b in range(LAYERS - N, LAYERS)),
    }
    assert all(alive for _, _, alive in waits)
    assert not fake.holding()


def test_fewer_than_two_blocks_in_flight_is_refused():
    with pytest.raises(ValueError, match="blocks_in_flight"):
        OffloadManager(blocks_in_flight=1)


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
    # the bound counts the host allocator's power-of-two blocks, not the nominal bytes
    assert manager.max_pinned_seen == sum(pinned_block_bytes(x[2]) for x in pinned) <= bound == manager.max_pinned_bytes
    assert pinned_block_bytes(172 * 2**20) == pinned_block_bytes(256 * 2**20) == 256 * 2**20  # gate/up at 7B, 8K
    assert manager.pageable_bytes == sum(x[2] for x in allocs if not x[1])
    assert manager.to_host_bytes == sum(x[2] for x in allocs)  # every copy to the host counted
    loss.backward()
    del loss
    gc.collect()
    assert manager.pinned_bytes == 0  # released with the handles after backward


def test_autocasts_weight_copies_are_cast_again_in_backward_not_sent_to_the_host(monkeypatch):
    """precision=bf16_mixed: autocast's bf16 copies of the fp32 weights are saved for backward; offload casts them
    again there rather than copying them to the host and back (the weights do not change before backward). The
    host copies shrink by exactly those copies' bytes, and the gradients equal an unoffloaded autocast run's."""
    from flexengine.surgery.memory import offload

    recast, real = [], offload._weight_cast_of

    def counted(t):
        weight = real(t)
        recast.extend([] if weight is None else [weight])
        return weight

    monkeypatch.setattr(offload, "_weight_cast_of", counted)

    def host_bytes(model, manager) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward_loss_sum(model, _batch())
        loss.backward()
        return manager.to_host_bytes

    base, model, manager, _ = _offloaded_model()
    fixed = host_bytes(model, manager)
    weights = {id(w): w.numel() * 2 for w in recast}  # each weight's bf16 copy, once per block call
    assert weights and all(w.dim() == 2 for w in recast)
    reference = clone_model(base)
    patch_attention(reference, mode="packed_doc", backend="dense")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward_loss_sum(reference.train(), _batch()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    monkeypatch.setattr(offload, "_weight_cast_of", lambda t: None)  # the copies sent to the host, as before
    _, model, manager, _ = _offloaded_model()
    assert host_bytes(model, manager) - fixed == sum(weights.values())
