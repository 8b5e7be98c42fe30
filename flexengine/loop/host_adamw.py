"""CPUOffloadAdamW: fp32 master weights and AdamW states in host memory, the update on the CPU.

Per parameter and step (optim.name=adamw_cpu_offload; precision=bf16_cpu_master):
  1. its gradient goes device -> host in the device dtype (bf16: 2 bytes a parameter, not fp32's 4) into its slot
     of one transfer buffer: pinned, allocated once at exact size (below), the same slot every step;
  2. the host converts the slot to fp32 in a scratch the size of the largest parameter (bf16 -> fp32 is exact),
     applies the clip coefficient, and steps the fp32 master with torch's fused CPU AdamW (one pass over
     master, grad and states; foreach AdamW costs ~7x more per parameter and allocates a full-size sqrt
     temporary);
  3. it rounds the master into the same slot (round-to-nearest, as a bf16 copy_ does) and uploads it on a side
     stream while the next parameter steps.
Host bytes per trainable parameter: fp32 master 4 + two fp32 states 8 + the slot (the device dtype's size), plus
one fp32 scratch of the largest parameter; PCIe: twice the device dtype's size per step (planning/costs.py counts
both: host_optimizer_bytes, host_optimizer_seconds).

Pinned memory: a non-blocking device -> host copy into an unpinned tensor allocates pinned memory through the
CUDA host caching allocator, which rounds each block up to a power of two (25.7 GiB -> 34 GiB at 6.9B fp32);
`torch.empty(..., pin_memory=True)` goes through the same allocator. The buffer here is ordinary host memory
page-locked in place with cudaHostRegister (as torch.distributed.checkpoint's stager does): exactly its size.
On a machine without CUDA nothing can be pinned: the same code path runs on a plain buffer with plain copies.

Overlap. Inside `collecting_grads()` (the trainer wraps the last micro-batch's backward in it) each parameter's
gradient starts its device -> host copy the moment autograd has accumulated it (a post-accumulate-grad hook), so
the downloads run under the rest of the backward. The AdamW update itself waits for the last gradient of the
window, on purpose: it needs two facts about *all* gradients first, the clip coefficient (the global norm) and
whether any gradient is non-finite (train.skip_nonfinite skips the whole update). Stepping a parameter earlier
and then learning that the norm clips or that a later gradient is NaN would need the old masters and states back:
their full copy (12 bytes a parameter), or an inexact inverse of the update. The exact alternative is taken: the
downloads overlap the backward, the uploads overlap the host step, and the clip coefficient is applied on the
host in fp32 (the device gradients are never scaled: they may already be on their way down). Under torchrun the
hooks stay off (DDP reduces after accumulation; FSDP2 assigns reduced shards without one) and `step()` downloads.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Iterator, List, Literal, Optional, Protocol, Union

import torch
from torch import nn

from flexengine.loop.grad_norm import total_norm
from flexengine.surgery.memory.offload import CudaStreams
from flexengine.surgery.parallel import is_dtensor, local_shard

_ALIGN = 64  # bytes: each slot of the transfer buffer starts on a cache line
_CLIP_EPS = 1e-6  # clip_grad_norm_'s: coefficient max_norm / (norm + eps)


def _register_pinned(buffer: torch.Tensor) -> bool:
    """Page-lock an existing host tensor in place (exact size; no caching-allocator rounding). False if refused."""
    return int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)) == 0


def transfer_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """One flat host byte buffer of exactly `nbytes`, page-locked when `pin` and CUDA allows; (buffer, pinned)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    return buffer, pin and nbytes > 0 and _register_pinned(buffer)


def _without_step_hooks(step):
    """A torch optimizer class's step without the wrapper torch adds to a class when it is first instantiated
    (profiling + step pre/post hooks): the host step calls AdamW's once per parameter, and hooks registered on this
    optimizer must run once per step, around the whole of it."""
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class _CopyEvent(Protocol):
    """What a download's event is used for: waiting until the copy has landed (a torch.cuda.Event)."""

    def synchronize(self) -> None: ...


class CPUOffloadAdamW(torch.optim.AdamW):
    """AdamW whose fp32 master weights and states live in host memory (the device keeps only weights and grads).

    The torch.optim.AdamW underneath holds the host masters as its parameters (fused CPU kernel); `_pairs` are
    (device parameter, host master). Under FSDP2 each rank offloads only its own shard. See the module docstring
    for the transfer path, the overlap and why the update waits for the whole window's gradients.
    """

    def __init__(self, groups: List[dict], *, streams: Optional[CudaStreams] = None, **adamw_kwargs):
        device_params = [p for group in groups for p in group["params"]]
        on_cuda = any(local_shard(p).is_cuda for p in device_params)
        self._streams = (
            streams if streams is not None or not on_cuda else CudaStreams(local_shard(device_params[0]).device)
        )
        offsets, total = [], 0
        for p in device_params:
            offsets.append(total)
            total += -(-local_shard(p).numel() * local_shard(p).element_size() // _ALIGN) * _ALIGN
        self._buffer, self.pinned = transfer_buffer(total, pin=on_cuda)
        if self.pinned:  # unregistered before the memory goes back to the C allocator (the finalizer holds it)
            weakref.finalize(self, _unregister, self._buffer)
        self._pairs: List[tuple[nn.Parameter, nn.Parameter]] = []
        self._slots: List[torch.Tensor] = []  # each parameter's view of the transfer buffer, in the device dtype
        host_groups, i = [], 0
        for group in groups:
            masters = []
            for p in group["params"]:
                shard = local_shard(p)
                master = nn.Parameter(shard.detach().to("cpu", torch.float32, copy=True))
                nbytes = shard.numel() * shard.element_size()
                slot = self._buffer[offsets[i] : offsets[i] + nbytes].view(shard.dtype).view(shard.shape)
                self._pairs.append((p, master))
                self._slots.append(slot)
                masters.append(master)
                i += 1
            host_groups.append({**group, "params": masters})
        # bf16 gradients are converted here before the fused kernel (it wants the master's dtype); fp32 slots are used
        # as they are
        widest = max((s.numel() for s in self._slots if s.dtype != torch.float32), default=0)
        self._scratch = torch.empty(widest, dtype=torch.float32)
        self._index = {id(p): k for k, (p, _) in enumerate(self._pairs)}
        # slots whose download has started, in the order they started: {k: its event (True on CPU)}
        self._arrived: dict[int, Union[_CopyEvent, Literal[True]]] = {}
        self.hook_downloads = 0  # gradients that went down from a hook, under the backward (tests, bench)
        self._clip: Optional[tuple[float, torch.Tensor]] = None  # (max_norm, total norm) set by clip_grad_norm
        super().__init__(host_groups, fused=True, **adamw_kwargs)

    # -- host bytes, for the planner's check (bench/host_optimizer.py) -------------------------------------------
    def host_bytes(self) -> dict[str, int]:
        """Bytes this optimizer holds in host memory, by part."""
        states = sum(
            v.numel() * v.element_size() for s in self.state.values() for v in s.values() if torch.is_tensor(v)
        )
        masters = sum(m.numel() * m.element_size() for _, m in self._pairs)
        return {
            "masters": masters,
            "states": states,
            "transfer_buffer": self._buffer.numel(),
            "grad_scratch": self._scratch.numel() * 4,
        }

    # -- the last micro-batch's backward ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def collecting_grads(self) -> Iterator[None]:
        """Download each gradient as soon as autograd has accumulated it (wrap the window's last backward only)."""
        if torch.distributed.is_initialized():  # DDP/FSDP2 reduce after accumulation: step() downloads instead
            yield
            return
        # registered for this backward only: a hook left behind would keep this optimizer (and its host memory)
        # alive through the parameters after it is dropped
        handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p, _ in self._pairs]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _on_grad(self, p: torch.Tensor) -> None:
        self._download(self._index[id(p)])
        self.hook_downloads += 1

    def _download(self, k: int) -> None:
        """Start the device -> host copy of parameter k's gradient into its slot (a later call overwrites it)."""
        grad = self._pairs[k][0].grad
        assert grad is not None  # called from its post-accumulate hook, or by step() after checking it
        grad = local_shard(grad)
        streams = self._streams
        if streams is None:
            self._slots[k].copy_(grad)
            self._arrive(k, True)
            return
        streams.side_waits_for_compute()  # the gradient is written by the compute queued so far
        with streams.on_side():
            self._slots[k].copy_(grad, non_blocking=True)
        streams.used_on_side(grad)  # a skipped step frees the grads before this copy may have read them
        self._arrive(k, streams.record())

    def _arrive(self, k: int, event: Union[_CopyEvent, Literal[True]]) -> None:
        self._arrived.pop(k, None)  # downloaded again (a reentrant backward): the later copy, in its new place
        self._arrived[k] = event

    # -- clipping --------------------------------------------------------------------------------------------------
    def clip_grad_norm(self, params, max_norm: float) -> torch.Tensor:
        """The gradients' total norm in fp32 (of bf16 grads too); the clip to max_norm is applied on the host in step()
        (device grads untouched)."""
        norm = total_norm([p.grad for p in params if p.grad is not None])
        self._clip = (max_norm, norm) if math.isfinite(max_norm) else None
        return norm

    def _clip_coef(self) -> float:
        if self._clip is None:
            return 1.0
        max_norm, norm = self._clip
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return min(1.0, max_norm / (float(norm) + _CLIP_EPS))

    # -- the step --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Per parameter: its gradient on the host (downloaded now unless a hook did), fused AdamW on the fp32
        master, the rounded master uploaded on the side stream while the next one steps."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coef = self._clip_coef()
        streams = self._streams
        if streams is not None:
            streams.side_waits_for_compute()  # uploads must not overwrite weights that queued compute still reads
        # in the order the downloads started (the backward's: last block first), so the host steps the gradients
        # that landed first while the last ones are still crossing; the values do not depend on the order
        order = list(self._arrived) + [k for k in range(len(self._pairs)) if k not in self._arrived]
        adamw_step = _without_step_hooks(torch.optim.AdamW.step)
        for k in order:
            device_p, master = self._pairs[k]
            if k not in self._arrived:
                if device_p.grad is None:
                    continue  # unused this step: AdamW leaves it (and its states) alone, as torch's does
                self._download(k)
            event = self._arrived[k]
            if event is not True:
                event.synchronize()  # this slot's download has landed (CUDA)
            master.grad = self._host_grad(k, coef)
            adamw_step(self)  # only this master has a gradient: torch's AdamW steps it alone
            master.grad = None
            self._upload(k)
        self._arrived = {}
        self._clip = None
        if streams is not None:
            streams.compute_waits(streams.record())  # the next forward reads the uploaded weights
        return loss

    def _host_grad(self, k: int, coef: float) -> torch.Tensor:
        """Parameter k's gradient in fp32 on the host, times the clip coefficient."""
        slot = self._slots[k]
        grad = slot if slot.dtype == torch.float32 else self._scratch[: slot.numel()].view(slot.shape).copy_(slot)
        if coef < 1.0:
            grad = grad.mul_(coef) if grad is not slot else grad * coef  # the slot itself stays the device's grad
        return grad

    def _upload(self, k: int) -> None:
        """Round master k into its slot and copy it to the device parameter (on the side stream under CUDA)."""
        device_p, master = self._pairs[k]
        slot = self._slots[k]
        slot.copy_(master)
        if self._streams is None:
            local_shard(device_p).copy_(slot)
            return
        with self._streams.on_side():
            local_shard(device_p).copy_(slot, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the device grads and forget downloads of a step that was skipped."""
        for device_p, master in self._pairs:
            device_p.grad = None
            master.grad = None
        self._arrived = {}
        self._clip = None

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """AdamW's states plus the fp32 masters: bf16 device weights alone cannot restore them exactly. References,
        like torch's own states, not copies: a clone is 4 B/param more host memory at every save (25.7 GiB at 7B,
        which the planner's host term does not hold). Safe because the save is synchronous: Trainer.save hands
        them to torch.save before the next step can change them. A caller keeping the dict across steps copies."""
        return {**super().state_dict(), "fp32_masters": [m.detach() for _, m in self._pairs]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore states and the fp32 masters. A state without masters (another optimizer's checkpoint resumed
        here: adamw's, or precision=auto choosing bf16_cpu_master on a requeue) re-reads the device weights."""
        state_dict = dict(state_dict)
        masters = state_dict.pop("fp32_masters", None)
        with torch.no_grad():
            for i, (device_p, master) in enumerate(self._pairs):
                master.copy_(masters[i] if masters is not None else local_shard(device_p).float())
        super().load_state_dict(state_dict)

    def master_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{state-dict name: fp32 master} for the model's trainable parameters, for the HF export; empty when the
        masters are shards (FSDP2: the export gathers the device copies)."""
        if any(is_dtensor(p) for p, _ in self._pairs):
            return {}
        masters = {id(p): m.detach() for p, m in self._pairs}
        return {name: masters[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in masters}
