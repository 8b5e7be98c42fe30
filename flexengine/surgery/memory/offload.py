"""CPU activation offload per decoder block: saved tensors go to (pinned) host memory during forward and come
back one block ahead of their use in backward, with the copies on a side CUDA stream so they overlap compute.

The hooks wrap the block's `__call__` (`flexengine.surgery.memory.policy.MemoryBlock`, one class shared by every
block), so they sit outside the block's forward: outside `torch.compile` (dynamo cannot trace saved-tensor hooks;
around a compiled region they cause no break and no recompile) and outside a checkpoint (hooks inside one would
disable it; outside, they see only the checkpoint's positional inputs). On CPU the same path runs without pinning
or streams.

Ordering (CUDA): every copy runs on one side stream. A handle records an event after its device->host copy
and another after its prefetch back; compute waits on the event of the handle it needs, never on the whole side
stream, so the prefetch of the block before keeps running while this block's backward computes. Pinned host
memory is bounded (`max_pinned_bytes`): past the bound, copies go to pageable memory (they then block the
host) and the manager counts them. All CUDA calls go through `CudaStreams`, which a CPU test replaces with a
recording fake to check the order of copies, events and waits.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from flexengine.core.units import GiB

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
# (costs.pinned_bound_bytes): a 7B at 8K offloads ~51 GB per row, times the ranks of a node (issue #16)


class _Group:
    """What one block call offloaded; `prev` is the block run just before it in the same forward."""

    def __init__(self, index: int, prev: Optional["_Group"]):
        self.index, self.prev = index, prev
        self.handles: list[weakref.ref] = []
        # Several saved tensors can be views of one storage (attention output and o_proj's input): copy it once.
        self.seen: dict[int, tuple[StorageWeakRef, weakref.ref]] = {}
        self.prefetched = False


class _Handle:
    """One offloaded storage: its host bytes, its device bytes once prefetched, and the events marking the
    end of each copy on the side stream (None on CPU)."""

    def __init__(self, group: _Group, host: Optional[Tensor], device: torch.device):
        self.group, self.host, self.device = group, host, device
        self.on_device: Optional[Tensor] = None
        self.offloaded: Any = None  # event: the device -> host copy has finished
        self.prefetched: Any = None  # event: the host -> device copy has finished


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

    def used_on_compute(self, t: Tensor) -> None:
        """t was allocated on the side stream and is used by compute from now on."""
        t.record_stream(torch.cuda.current_stream(self.device))

    def host_buffer(self, t: Tensor, pinned: bool) -> Tensor:
        """Host memory for a copy of t."""
        return torch.empty_like(t, device="cpu", pin_memory=pinned)


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


def _is_parameter_view(t: Tensor) -> bool:
    base = t._base if t._base is not None else t
    # weights (or views of them) stay resident anyway; frozen ones (LoRA's base) have requires_grad off
    return base.is_leaf and (base.requires_grad or isinstance(base, torch.nn.Parameter))


def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class OffloadManager:
    """Saved-tensor hooks for the blocks it is attached to; one side stream per model."""

    def __init__(
        self,
        min_bytes: int = 1024,
        max_pinned_bytes: int = DEFAULT_MAX_PINNED_BYTES,
        streams: Optional[CudaStreams] = None,
    ):
        self.min_bytes = min_bytes  # smaller tensors (norm statistics) are not worth a copy
        self.max_pinned_bytes = max_pinned_bytes
        self.pinned_bytes = 0  # pinned host bytes held by live handles
        self.pageable_bytes = 0  # bytes that went to pageable memory past the bound (cumulative)
        self._streams = streams  # created on the first CUDA tensor unless given
        self._last: Optional[weakref.ref] = None

    @contextlib.contextmanager
    def block(self, index: int, kwargs: dict) -> Iterator[None]:
        """Run one block call with its saved tensors offloaded."""
        last = self._last() if self._last is not None else None
        group = _Group(index, last if last is not None and last.index < index else None)
        # Keyword tensors (rotary cos/sin, masks) are shared by all blocks of the batch: never copy them per block.
        shared = {t.untyped_storage().data_ptr() for t in _tensors(kwargs)}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, shared, t), self._unpack):
            yield
        self._last = weakref.ref(group)

    # -- forward: device -> host ----------------------------------------------------------------------------
    def _pack(self, group: _Group, shared: set, t: Tensor) -> Any:
        if (
            not t.is_floating_point()
            or t.numel() * t.element_size() < self.min_bytes
            or _is_parameter_view(t)
            or t.untyped_storage().data_ptr() in shared
        ):
            return t
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

    def _pinned(self, nbytes: int, handle: _Handle) -> bool:
        """Reserve pinned bytes for a handle within the bound (released when the handle dies)."""
        if self.pinned_bytes + nbytes > self.max_pinned_bytes:
            if self.pageable_bytes == 0:
                log.warning(
                    "activation offload: %.1f GiB of pinned host memory in use (the bound); further "
                    "copies use pageable memory and do not overlap compute",
                    self.pinned_bytes / GiB,
                )
            self.pageable_bytes += nbytes
            return False
        self.pinned_bytes += nbytes
        weakref.finalize(handle, self._release, nbytes)
        return True

    def _release(self, nbytes: int) -> None:
        self.pinned_bytes -= nbytes

    def _to_host(self, group: _Group, t: Tensor) -> _Handle:
        with host_copies():
            streams = self._streams_for(t)
            if streams is None:  # CPU: same path, no pinning, no stream (exact grads)
                return _Handle(group, torch.empty_like(t).copy_(t), t.device)
            handle = _Handle(group, None, t.device)
            handle.host = streams.host_buffer(t, pinned=self._pinned(t.numel() * t.element_size(), handle))
            streams.side_waits_for_compute()
            with streams.on_side():
                handle.host.copy_(t, non_blocking=True)
            streams.used_on_side(t)
            handle.offloaded = streams.record()
            return handle

    # -- backward: host -> device, one block ahead ----------------------------------------------------------
    def _unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Packed):
            return packed
        group = packed.handle.group
        if not group.prefetched:  # the first tensor this block needs: start bringing back the block before it
            group.prefetched = True
            if group.prev is not None:
                self._prefetch(group.prev)
        return _as_view(self._fetch(packed.handle), packed.view)

    def _prefetch(self, group: _Group) -> None:
        for ref in group.handles:
            handle = ref()
            if handle is None or handle.offloaded is None or handle.on_device is not None:
                continue
            with self._streams.on_side():  # after its own device -> host copy, in stream order
                handle.on_device = handle.host.to(handle.device, non_blocking=True)
            handle.prefetched = self._streams.record()

    def _fetch(self, handle: _Handle) -> Tensor:
        if handle.offloaded is None:  # CPU
            return handle.host
        if handle.on_device is None:  # not prefetched (the first block of backward): copy on this stream
            self._streams.compute_waits(handle.offloaded)
            return handle.host.to(handle.device, non_blocking=True)
        self._streams.compute_waits(handle.prefetched)  # this handle's copy only: later prefetches keep running
        self._streams.used_on_compute(handle.on_device)
        return handle.on_device
