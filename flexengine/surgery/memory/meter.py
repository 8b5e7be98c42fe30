"""Measure the bytes a forward keeps alive for backward, per decoder block (CPU and GPU).

A TorchDispatchMode records a weak reference to the storage of every op output created during the forward;
what is still alive once the forward returns (while its output, hence the autograd graph, is alive) is exactly
what backward will read: tensors saved by autograd, SAC's cache and checkpoint closures alike (a
saved-tensor-hooks count misses the last two). Storages are attributed to the block whose forward created
them (everything else -- embeddings, rotary tables, the mask, the loss -- is "other").

A dispatch mode sees eager ops only (a compiled graph's kernels never reach it), so the meter runs compiled code
eagerly: under `torch.compiler.set_stance("force_eager")` dynamo does not try to compile under the mode. Without
it dynamo refuses the frame ("non-infra torch dispatch mode present"): with fullgraph=True an error, and the
refusal is remembered for the code object, so the same blocks then run uncompiled after the meter too.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flexengine.surgery.memory.layers import decoder_layers
from flexengine.surgery.memory.offload import making_host_copies


@dataclass
class ActivationReport:
    """Bytes alive for backward after one forward."""

    total_bytes: int  # on the compute device (or CPU on CPU), excluding offloaded host copies
    per_block: list[int]  # created by each decoder block
    other_bytes: int  # created outside the blocks (embeddings, rotary tables, mask, final norm, loss)
    offloaded_bytes: int = 0  # host copies made by activation offload
    cuda_peak_bytes: Optional[int] = None  # torch.cuda.max_memory_allocated during the forward (CUDA only)

    def as_dict(self) -> dict:
        """JSON-ready form (summary.json, bench results)."""
        return {
            "activation_bytes": self.total_bytes,
            "activation_bytes_per_block": list(self.per_block),
            "activation_other_bytes": self.other_bytes,
            "activation_offloaded_bytes": self.offloaded_bytes,
            "forward_cuda_peak_bytes": self.cuda_peak_bytes,
        }


class _AliveOutputs(TorchDispatchMode):
    """Weak refs to the storages of op outputs, tagged with the block that made them."""

    def __init__(self):
        super().__init__()
        self.block = -1  # -1 = outside every decoder block
        self.records: dict[int, tuple[StorageWeakRef, int, int, bool]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage._cdata in inputs:  # a view or in-place result: counted where its storage was created
                continue
            # keyed by the StorageImpl: a freed storage's key may be reused, then the newer record wins
            self.records[storage._cdata] = (StorageWeakRef(storage), storage.nbytes(), self.block, making_host_copies())
        return out


@contextmanager
def metering(mode: TorchDispatchMode) -> Iterator[None]:
    """`mode` on, compiled code run eagerly inside it (the module docstring says why)."""
    with torch.compiler.set_stance("force_eager"), mode:
        yield


def measure_activations(
    model: nn.Module, forward: Callable[[], Tensor], layers: Optional[nn.ModuleList] = None
) -> tuple[ActivationReport, Tensor]:
    """Run `forward()` (eager) and report what it leaves alive for backward; returns (report, its output).

    Keep the returned output alive if you want to call backward on it; the report is taken before it returns.
    """
    layers = layers if layers is not None else decoder_layers(model)
    mode = _AliveOutputs()
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(mode, "block", i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: setattr(mode, "block", -1)))
    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        with metering(mode):
            out = forward()
    finally:
        for h in handles:
            h.remove()
    per_block, other, offloaded = [0] * len(layers), 0, 0
    for ref, nbytes, block, host in mode.records.values():
        if ref.expired():
            continue
        if host:
            offloaded += nbytes
        elif block >= 0:
            per_block[block] += nbytes
        else:
            other += nbytes
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    report = ActivationReport(sum(per_block) + other, per_block, other, offloaded, peak)
    return report, out


class _PeakLive(TorchDispatchMode):
    """Peak bytes of op outputs alive at once (weak refs to their storages): a working set on any device."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.alive[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        live = 0
        for key, (ref, nbytes) in list(self.alive.items()):
            if ref.expired():
                del self.alive[key]
            else:
                live += nbytes
        self.peak = max(self.peak, live)
        return out


def measure_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensors created inside `fn()` and alive at the same time (forward, recompute and backward
    alike; tensors that existed before are not counted). Compiled code runs eagerly inside it (metering), so
    what it measures is the eager working set."""
    mode = _PeakLive()
    with metering(mode):
        fn()
    return mode.peak
