"""CPU activation offload per decoder block: saved tensors go to (pinned) host memory during forward and come
back one block ahead of their use in backward, with the copies on a side CUDA stream so they overlap compute.

The hooks wrap the block's `__call__` (`flexengine.memory.policy.MemoryBlock`, one class shared by every
block), so they sit outside the block's forward: outside `torch.compile` (dynamo cannot trace saved-tensor hooks;
around a compiled region they cause no break and no recompile) and outside a checkpoint (hooks inside one would
disable it; outside, they see only the checkpoint's positional inputs). On CPU the same path runs without pinning
or streams.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

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
    """Whether the tensors being created now are offload's host copies (read by flexengine.memory.meter)."""
    return _HOST_COPY_DEPTH[0] > 0


class _Group:
    """What one block call offloaded; `prev` is the block run just before it in the same forward."""

    def __init__(self, index: int, prev: Optional["_Group"]):
        self.index, self.prev = index, prev
        self.handles: list[weakref.ref] = []
        # Several saved tensors can be views of one storage (attention output and o_proj's input): copy it once.
        self.seen: dict[int, tuple[StorageWeakRef, weakref.ref]] = {}
        self.prefetched = False


class _Handle:
    """One offloaded storage: its host bytes, and its device bytes once prefetched."""

    def __init__(self, group: _Group, host: Tensor, device: torch.device):
        self.group, self.host, self.device = group, host, device
        self.on_device: Optional[Tensor] = None


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
        storage_bytes.untyped_storage(), offset, shape, stride)


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

    def __init__(self, min_bytes: int = 1024):  # blocks enter `block(index, kwargs)` around each call
        self.min_bytes = min_bytes  # smaller tensors (norm statistics) are not worth a copy
        self._stream: Optional[torch.cuda.Stream] = None
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
        if (not t.is_floating_point() or t.numel() * t.element_size() < self.min_bytes or _is_parameter_view(t)
                or t.untyped_storage().data_ptr() in shared):
            return t
        storage = t.untyped_storage()
        hit = group.seen.get(storage._cdata)
        handle = hit[1]() if hit is not None and not hit[0].expired() else None
        if handle is None:
            handle = _Handle(group, self._to_host(_storage_bytes(t)), t.device)
            group.handles.append(weakref.ref(handle))
            group.seen[storage._cdata] = (StorageWeakRef(storage), weakref.ref(handle))
        return _Packed(handle, t)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, t: Tensor) -> Tensor:
        with host_copies():
            if t.device.type != "cuda":
                return torch.empty_like(t).copy_(t)  # CPU: same path, no pinning, no stream (exact grads)
            stream = self._side_stream(t.device)
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written before we read it
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator must not reuse t's memory before the copy has read it
            return host

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
            if handle is None or handle.device.type != "cuda" or handle.on_device is not None:
                continue
            with torch.cuda.stream(self._side_stream(handle.device)):
                handle.on_device = handle.host.to(handle.device, non_blocking=True)

    def _fetch(self, handle: _Handle) -> Tensor:
        if handle.device.type != "cuda":
            return handle.host
        current = torch.cuda.current_stream(handle.device)
        current.wait_stream(self._side_stream(handle.device))  # its D2H (and prefetch H2D) have finished
        if handle.on_device is None:
            return handle.host.to(handle.device, non_blocking=True)
        tensor = handle.on_device
        tensor.record_stream(current)  # allocated on the side stream, used on this one
        return tensor
