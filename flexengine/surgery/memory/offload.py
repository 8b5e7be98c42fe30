"""CPU activation offload per decoder block: saved tensors go to (pinned) host memory during forward and come
back one block ahead of their use in backward, with the copies on a side CUDA stream so they overlap compute.

The hooks wrap the block's `__call__` (`flexengine.surgery.memory.policy.MemoryBlock`, one class shared by every
block), so they sit outside the block's forward: outside `torch.compile` (dynamo cannot trace saved-tensor hooks;
around a compiled region they cause no break and no recompile) and outside a checkpoint (hooks inside one would
disable it; outside, they see only the checkpoint's positional inputs). On CPU the same path runs without pinning
or streams.

Device memory (CUDA). Every device tensor offload holds comes from the compute stream's pool: the saved tensors
themselves, and the buffers backward's prefetch copies into (allocated on the compute stream, filled by the side
stream). A tensor allocated on the side stream would come from that stream's own pool, which compute never reuses;
so no tensor is allocated there. Nor is `record_stream` used: it keeps a block from reuse until the side stream has
done everything queued when the block is freed, and with copies slower than compute (~33-38 ms against ~25-30 ms
a block at 7B width) that is ever more blocks. Instead compute waits on the copy's event before the memory is
handed back (`_Handle.guard`).

At most `OFFLOAD_BLOCKS_IN_FLIGHT` blocks hold device memory for offload at any time, whatever the copy speed:
- forward: a handle keeps its saved tensor until its device -> host copy is known done. Before block i's
  tensors are packed, compute waits on the copy event of block i - N and that block's tensors are released, so
  blocks i - N + 1 .. i hold device memory (i is the one being computed);
- backward: block g's first unpack prefetches block g - 1: g (being consumed) and g - 1 hold device memory. A
  block whose saved tensors are still held (the last ones of the forward) is used in place, not copied back.
The planner counts the same bound (`planning/planner.py`, the offload_in_flight term).

Ordering: every copy runs on one side stream. A device -> host copy starts after the compute queued so far
(which wrote the tensor); a prefetch starts after the compute queued so far (which may still use the memory its
buffer was given); compute waits on one handle's event, never on the whole side stream, so the prefetch of the
block before keeps running while this block's backward computes. Pinned host memory is bounded
(`max_pinned_bytes`): past the bound, copies go to pageable memory (they then block the host) and the manager
counts them; the bound counts the host allocator's power-of-two blocks. Autocast's bf16 copies of the weights
(saved by the matmuls of precision=bf16_mixed) are not copied at all: backward casts the weight again. All CUDA
calls go through `CudaStreams`, which a CPU test replaces with a recording fake to check
the order of copies, events and waits, the stream each buffer comes from, and the blocks in flight.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from flexengine.core.units import GiB

# Blocks whose saved tensors may occupy device memory at once (module docstring). 2 is the least that overlaps:
# block i - 1's copy runs while block i computes, and block g - 1 arrives while block g's backward runs. More
# would not be faster: when copies are slower than compute the side stream is the bottleneck and is kept busy
# with 2 already; when they are faster, 2 never waits.
OFFLOAD_BLOCKS_IN_FLIGHT = 2

_HOST_COPY_DEPTH = [0]  # >0 while this module copies saved tensors to host (the meter reports those bytes apart)


@contextlib.contextmanager
def host_copies() -> Iterator[None]:
    """Mark tensors created inside as offloaded host copies of saved activations."""
    _HOST_COPY_DEPTH[0] += 1
    try:
        yield
    finally:
        _HOST_COPY_DEPTH[0] -= 1


def making_host_copies() -> bool:
    """Whether the tensors being created now are offload's host copies (read by flexengine.surgery.memory.meter)."""
    return _HOST_COPY_DEPTH[0] > 0


log = logging.getLogger(__name__)
DEFAULT_MAX_PINNED_BYTES = 32 * GiB  # library use without a plan; a run takes the plan's per-rank host budget
# (costs.pinned_bound_bytes): a 7B at 8K offloads ~51 GB per row, times the ranks of a node


def pinned_block_bytes(nbytes: int) -> int:
    """Pinned host bytes a request of `nbytes` takes: torch's caching host allocator hands out blocks rounded up
    to a power of two (a 172 MiB gate/up activation takes 256 MiB), so the bound counts those."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


class _Group:
    """What one block call offloaded; `prev` is the block run just before it in the same forward."""

    def __init__(self, index: int, prev: Optional["_Group"]):
        self.index, self.prev = index, prev
        self.handles: list[weakref.ref] = []
        # Several saved tensors can be views of one storage (attention output and o_proj's input): copy it once.
        self.seen: dict[int, tuple[StorageWeakRef, weakref.ref]] = {}
        self.prefetched = False
        self.copied: Any = None  # event after this block's last device -> host copy (one side stream: all of them)

    def live_handles(self) -> list["_Handle"]:
        """The handles some saved tensor still refers to."""
        return [h for h in (ref() for ref in self.handles) if h is not None]

    def holds_saved_tensors(self) -> bool:
        """Whether some handle of this block still holds its saved tensor on the device."""
        return any(h.saved is not None for h in self.live_handles())


class _Handle:
    """One offloaded storage: its host bytes, its device bytes while held (`saved`: the saved storage itself,
    until its copy to host is known done; `on_device`: the copy brought back in backward), and the events marking
    the end of each copy on the side stream (None on CPU)."""

    def __init__(self, group: _Group, host: Optional[Tensor], device: torch.device):
        self.group, self.host, self.device = group, host, device
        self.saved: Optional[Tensor] = None
        self.on_device: Optional[Tensor] = None
        self.offloaded: Any = None  # event: the device -> host copy has finished
        self.prefetched: Any = None  # event: the host -> device copy has finished
        self.unwaited: Optional[weakref.finalize] = None  # armed while compute has not waited on the copy's event

    def guard(self, copy_done: Any, streams: "CudaStreams") -> None:
        """The device tensor held now (saved or on_device) is read or written by a side-stream copy until
        `copy_done`. It belongs to the compute stream's pool: once freed, the allocator hands its memory to the
        next compute-stream request at once, ordered after the compute queued so far but not after the side
        stream. So compute waits on `copy_done` before the memory goes back -- no `record_stream`, which would
        hold it until the side stream drained whatever it had queued by then. `compute_waited` (the normal path:
        compute used the copy, or the forward's bound waited on it) disarms the guard; otherwise (a backward that
        raised, a graph dropped unused) it queues the wait when the handle dies, before the tensor is freed
        (weakref callbacks run before an instance's attributes are cleared)."""
        self.unwaited = weakref.finalize(self, streams.compute_waits, copy_done)
        self.unwaited.atexit = False  # no CUDA calls at interpreter exit

    def host_copy(self) -> Tensor:
        """The host bytes (None only inside `_to_host`, between making the handle and its host buffer)."""
        assert self.host is not None, "an offload handle read before its host buffer was made"
        return self.host

    def compute_waited(self) -> None:
        """Compute has waited on the event of the copy that touched the held tensor: freeing it is safe."""
        if self.unwaited is not None:
            self.unwaited.detach()
            self.unwaited = None

    def release_saved(self) -> None:
        """Drop the saved tensor (compute has waited on its copy to host)."""
        self.compute_waited()
        self.saved = None


class CudaStreams:
    """The CUDA calls activation offload makes, in one place (a test substitutes a recording fake)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def on_side(self):
        """Context: queue work on the side stream."""
        return torch.cuda.stream(self.side)

    def side_waits_for_compute(self) -> None:
        """Copies queued from now on start after the compute queued so far (the tensor is written)."""
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def record(self) -> Any:
        """An event recorded on the side stream now (marks the copies queued so far)."""
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def compute_waits(self, event: Any) -> None:
        """Compute queued from now on starts after `event` (one handle's copy), not after the whole side stream."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def used_on_side(self, t: Tensor) -> None:
        """The allocator must not reuse t's memory before the side stream's queued work has read it."""
        t.record_stream(self.side)

    def host_buffer(self, t: Tensor, pinned: bool) -> Tensor:
        """Host memory for a copy of t."""
        return torch.empty_like(t, device="cpu", pin_memory=pinned)

    def device_buffer(self, host: Tensor, device: torch.device) -> Tensor:
        """Device memory for a copy of `host`, from the pool of the stream current now (offload calls it on the
        compute stream, never inside `on_side`)."""
        return torch.empty_like(host, device=device)


class _Packed:
    """A saved tensor as a view (offset, shape, strides, dtype) of an offloaded storage."""

    def __init__(self, handle: _Handle, t: Tensor):
        self.handle = handle
        self.view = (t.dtype, t.storage_offset(), tuple(t.shape), t.stride())


def _storage_bytes(t: Tensor) -> Tensor:
    """The whole storage behind `t` as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _as_view(storage_bytes: Tensor, view: tuple) -> Tensor:
    dtype, offset, shape, stride = view
    return torch.empty(0, dtype=dtype, device=storage_bytes.device).set_(
        storage_bytes.untyped_storage(), offset, shape, stride
    )


class _Recast:
    """A saved cast of a weight (autocast's bf16 copy of an fp32 parameter): cast again when backward needs it
    rather than copied to the host and back (the weight is unchanged until the optimizer steps, after backward)."""

    def __init__(self, weight: torch.nn.Parameter, t: Tensor):
        self.weight = weight
        self.view = (t.dtype, t.storage_offset(), tuple(t.shape), t.stride())

    def unpack(self) -> Tensor:
        return _as_view(_storage_bytes(self.weight.detach().to(self.view[0])), self.view)


def _weight_cast_of(t: Tensor) -> Optional[torch.nn.Parameter]:
    """The parameter `t` (or the tensor it views) is a dtype cast of, as autocast makes them; else None."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    weight = getattr(fn.next_functions[0][0], "variable", None)
    if not isinstance(weight, torch.nn.Parameter):
        return None
    same_layout = weight.shape == base.shape and weight.is_contiguous() and base.is_contiguous()
    return weight if same_layout and base.dtype != weight.dtype else None


def _is_parameter_view(t: Tensor) -> bool:
    base = t._base if t._base is not None else t
    # weights (or views of them) stay resident anyway; frozen ones (LoRA's base) have requires_grad off
    return base.is_leaf and (base.requires_grad or isinstance(base, torch.nn.Parameter))


def _shared_storages(kwargs: dict) -> set[int]:
    """The storages of a block call's keyword tensors (rotary cos/sin, masks): shared by all blocks of the batch,
    never copied per block."""
    return {t.untyped_storage().data_ptr() for t in tree_leaves(kwargs) if isinstance(t, Tensor)}


class OffloadManager:
    """Saved-tensor hooks for the blocks it is attached to; one side stream per model."""

    def __init__(
        self,
        min_bytes: int = 1024,
        max_pinned_bytes: int = DEFAULT_MAX_PINNED_BYTES,
        streams: Optional[CudaStreams] = None,
        blocks_in_flight: int = OFFLOAD_BLOCKS_IN_FLIGHT,
    ):
        if blocks_in_flight < 2:  # backward holds the block it consumes and the one it prefetches
            raise ValueError(f"blocks_in_flight={blocks_in_flight}: offload needs at least 2")
        self.min_bytes = min_bytes  # smaller tensors (norm statistics) are not worth a copy
        self.max_pinned_bytes = max_pinned_bytes
        self.blocks_in_flight = blocks_in_flight
        self.pinned_bytes = 0  # pinned host bytes held by live handles, as the host allocator rounds them
        self.pageable_bytes = 0  # bytes that went to pageable memory past the bound (cumulative)
        self.max_pinned_seen = 0  # the most pinned bytes held at once
        self.to_host_bytes = 0  # device -> host copies (cumulative; on CPU the host copies made)
        self.to_device_bytes = 0  # host -> device copies back, prefetched or on demand (cumulative)
        self._streams = streams  # created on the first CUDA tensor unless given
        self._last: Optional[weakref.ref] = None
        self._holding: list[_Group] = []  # forward's blocks that may still hold their saved tensors, oldest first

    @contextlib.contextmanager
    def block(self, index: int, kwargs: dict) -> Iterator[None]:
        """Run one block call with its saved tensors offloaded."""
        last = self._last() if self._last is not None else None
        group = _Group(index, last if last is not None and last.index < index else None)
        self._bound_in_flight()
        self._holding.append(group)
        shared = _shared_storages(kwargs)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, shared, t), self._unpack):
            yield
        self._last = weakref.ref(group)

    def _bound_in_flight(self) -> None:
        """Before a block packs anything: release the oldest blocks until fewer than N hold device memory, each
        after compute has waited on its last device -> host copy (so the memory is reused only after it)."""
        holding = [g for g in self._holding if g.holds_saved_tensors()]
        while len(holding) >= self.blocks_in_flight:
            oldest = holding.pop(0)
            self._cuda().compute_waits(oldest.copied)
            for handle in oldest.live_handles():
                handle.release_saved()
        self._holding = holding

    # -- forward: device -> host ----------------------------------------------------------------------------
    def _pack(self, group: _Group, shared: set, t: Tensor) -> Any:
        if (
            not t.is_floating_point()
            or t.numel() * t.element_size() < self.min_bytes
            or _is_parameter_view(t)
            or t.untyped_storage().data_ptr() in shared
        ):
            # kept as is, but detached: a node's own output returned by the hook would hold the node (grad_fn),
            # a cycle Python's collector cannot see, and a graph dropped without backward would never be freed
            return t.detach()
        weight = _weight_cast_of(t)
        if weight is not None:  # autocast's weight copy: cast again in backward, no PCIe, no host bytes
            return _Recast(weight, t)
        storage = t.untyped_storage()
        hit = group.seen.get(storage._cdata)
        handle = hit[1]() if hit is not None and not hit[0].expired() else None
        if handle is None:
            handle = self._to_host(group, _storage_bytes(t))
            group.handles.append(weakref.ref(handle))
            group.seen[storage._cdata] = (StorageWeakRef(storage), weakref.ref(handle))
        return _Packed(handle, t)

    def _streams_for(self, t: Tensor) -> Optional[CudaStreams]:
        """The stream interface for a device tensor (None: CPU, copies are plain and synchronous)."""
        if self._streams is None and t.device.type == "cuda":
            self._streams = CudaStreams(t.device)
        return self._streams

    def _cuda(self) -> CudaStreams:
        """The streams: only the CUDA path holds saved tensors and copy events, and it makes the streams first."""
        assert self._streams is not None, "activation offload: a CUDA copy without CUDA streams"
        return self._streams

    def counters(self) -> dict:
        """What offload moved and holds (bench/gpu_check_readme.py reads it per step)."""
        keys = ("to_host_bytes", "to_device_bytes", "pinned_bytes", "max_pinned_seen", "pageable_bytes")
        return {k: getattr(self, k) for k in keys}

    def _pinned(self, nbytes: int, handle: _Handle) -> bool:
        """Reserve pinned bytes for a handle within the bound (released when the handle dies), counted as the
        host allocator's rounded block (pinned_block_bytes)."""
        rounded = pinned_block_bytes(nbytes)
        if self.pinned_bytes + rounded > self.max_pinned_bytes:
            if self.pageable_bytes == 0:
                log.warning(
                    "activation offload: %.1f GiB of pinned host memory in use (the bound); further "
                    "copies use pageable memory and do not overlap compute",
                    self.pinned_bytes / GiB,
                )
            self.pageable_bytes += nbytes
            return False
        self.pinned_bytes += rounded
        self.max_pinned_seen = max(self.max_pinned_seen, self.pinned_bytes)
        weakref.finalize(handle, self._release, rounded)
        return True

    def _release(self, nbytes: int) -> None:
        self.pinned_bytes -= nbytes

    def _to_host(self, group: _Group, t: Tensor) -> _Handle:
        self.to_host_bytes += t.numel() * t.element_size()
        with host_copies():
            streams = self._streams_for(t)
            if streams is None:  # CPU: same path, no pinning, no stream (exact grads)
                return _Handle(group, torch.empty_like(t).copy_(t), t.device)
            handle = _Handle(group, None, t.device)
            handle.host = host = streams.host_buffer(t, pinned=self._pinned(t.numel() * t.element_size(), handle))
            streams.side_waits_for_compute()
            with streams.on_side():
                host.copy_(t, non_blocking=True)
            handle.offloaded = group.copied = streams.record()
            handle.saved = t  # until the bound releases it, or backward uses it in place
            handle.guard(handle.offloaded, streams)
            return handle

    # -- backward: host -> device, one block ahead ----------------------------------------------------------
    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, _Recast):
            return packed.unpack()
        if not isinstance(packed, _Packed):
            return packed
        group = packed.handle.group
        if not group.prefetched:  # the first tensor this block needs: start bringing back the block before it
            group.prefetched = True
            if group.prev is not None:
                self._prefetch(group.prev)
        return _as_view(self._fetch(packed.handle), packed.view)

    def _prefetch(self, group: _Group) -> None:
        todo = [h for h in group.live_handles() if h.offloaded is not None and h.saved is None and h.on_device is None]
        if not todo:  # always so on CPU (no copy events)
            return
        streams = self._cuda()
        # On the compute stream: its pool, which the block's backward frees them back to. The side stream starts
        # after the compute queued so far, the last user of whatever memory the allocator just handed out.
        buffers = [streams.device_buffer(h.host_copy(), h.device) for h in todo]
        streams.side_waits_for_compute()
        for handle, buffer in zip(todo, buffers):
            self.to_device_bytes += buffer.numel() * buffer.element_size()
            with streams.on_side():  # after the block's own device -> host copies, in stream order
                buffer.copy_(handle.host_copy(), non_blocking=True)
            handle.on_device, handle.prefetched = buffer, streams.record()
            handle.guard(handle.prefetched, streams)

    def _fetch(self, handle: _Handle) -> Tensor:
        if handle.offloaded is None:  # CPU
            return handle.host_copy()
        if handle.saved is not None:  # one of the forward's last blocks, still on the device: used in place (a
            return handle.saved  # read needs no wait; the guard waits on its copy to host before it is freed)
        if handle.on_device is None:  # released and not prefetched: copy back on the compute stream, now
            streams, host = self._cuda(), handle.host_copy()
            streams.compute_waits(handle.offloaded)
            handle.on_device = streams.device_buffer(host, handle.device)
            handle.on_device.copy_(host, non_blocking=True)
            self.to_device_bytes += host.numel() * host.element_size()
        elif handle.unwaited is not None:
            self._cuda().compute_waits(handle.prefetched)  # this handle's copy only: later prefetches keep running
            handle.compute_waited()
        return handle.on_device
