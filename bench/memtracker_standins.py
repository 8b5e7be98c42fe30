"""Stand-ins that let PyTorch's MemTracker watch the engine's training step over fake CPU tensors (see
bench/memtracker_step.py); tests/planning/test_planner_vs_memtracker.py proves each saves what the real op saves.

- flex attention -> `flex_stand_in`, a custom op the bench's SAC policy saves as it saves flex: MemTracker has no
  rule for flex, and eager flex refuses dispatch modes. Its autograd saves what compiled flex saves (q, k, v, out,
  lse; eager flex also keeps max_scores, 4 bytes per token and head, which its backward never reads), after the
  same autocast cast of q, k and v (flex's Autocast rule); its output has q's stride order, as flex's has; its
  values are not attention's.
- the chunked loss -> lm_head applied as `F.linear` on its weight: MemTracker refuses a module called more than
  once in one forward, and the chunked loss calls lm_head once per chunk.
- host memory -> the meta device: activation offload's host copies come from a streams object (the one the
  offload manager takes on CUDA) whose host buffers are meta tensors, so device and host bytes are told apart
  and the prefetch back to the device happens as on a GPU. Its flat views of a storage are made with as_strided
  instead of `set_` (which keeps a fake storage alive for ever). Fake storages all report data pointer 0, by which
  the manager tells the batch's shared keyword tensors (rotary cos/sin) apart from a block's own: so no keyword
  tensor is exempted here, and each offloaded block also copies cos/sin to the host (2 x B x S x head_dim x 2
  bytes, 4 MiB at 8K; the device keeps them either way).
- torchao's optimizer step (bf16_sr) runs eagerly (its compiled step refuses a dispatch mode): its temporaries,
  which inductor fuses on a GPU, show in the optimizer phase only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import flexengine.surgery.loss as engine_loss
import flexengine.surgery.memory.offload as engine_offload
from flexengine.surgery.applied import applied
from flexengine.surgery.attention.patch import CP_ATTENTION
from flexengine.surgery.family import family_of
from flexengine.surgery.memory import sac as memory_sac
from flexengine.surgery.memory.offload import CudaStreams


# -- flex attention ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("flexengine_bench::flex_stand_in", mutates_args=())
def flex_stand_in(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """flex_attention's outputs by shape, dtype and layout: out [B, Hq, S, D] in q's stride order (as flex makes
    it), logsumexp [B, Hq, S] fp32; the values are not attention's."""
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@flex_stand_in.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _flex_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    # what compiled flex saves for its backward (min-cut partition of flex's joint graph): q, k, v, out and lse;
    # the block mask's tensors are the batch's, not the layer's
    ctx.save_for_backward(*inputs, *output)


def _flex_backward(ctx: Any, grad_out: Tensor, grad_lse: Optional[Tensor]) -> tuple:
    q, k, v = ctx.saved_tensors[:3]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


flex_stand_in.register_autograd(_flex_backward, setup_context=_flex_setup)
FLEX_STAND_IN = torch.ops.flexengine_bench.flex_stand_in.default


class FlexStandIn(nn.Module):
    """Takes flex's place in the attention patch (its CP_ATTENTION hook): flex's autocast cast, then the op."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, **flex_kwargs) -> Tensor:
        """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> out [B, Hq, S, D] (flex_kwargs: block_mask, scale, enable_gqa)."""
        device = q.device.type
        if torch.is_autocast_enabled(device):  # flex's Autocast rule casts q, k, v to the autocast dtype
            dtype = torch.get_autocast_dtype(device)
            q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
        return flex_stand_in(q, k, v)[0]


def install_flex_stand_in(model: nn.Module) -> None:
    """Every attention module calls the stand-in where it would call flex, and op-level SAC saves its outputs."""
    family = family_of(model)
    for layer in family.decoder_layers(model):
        setattr(getattr(layer, family.attention.module), CP_ATTENTION, FlexStandIn())
    memory_sac._SAVED_OPS.add(FLEX_STAND_IN)


def functional_chunk_loss_sum(hidden_NH: Tensor, targets_N: Tensor, lm_head: nn.Module) -> Tensor:
    """surgery.loss._chunk_loss_sum with lm_head applied as F.linear (what nn.Linear.forward calls)."""
    logits = F.linear(hidden_NH, lm_head.weight, lm_head.bias).float()
    return F.cross_entropy(logits, targets_N, reduction="sum")


@contextlib.contextmanager
def functional_loss() -> Iterator[None]:
    """The engine's chunked loss with `functional_chunk_loss_sum` for each chunk."""
    real = engine_loss._chunk_loss_sum
    engine_loss._chunk_loss_sum = functional_chunk_loss_sum
    try:
        yield
    finally:
        engine_loss._chunk_loss_sum = real


class HostOnMeta(CudaStreams):
    """offload.CudaStreams with host memory on the meta device: no streams, events are placeholders (every CUDA
    call it makes is overridden: a new one the manager starts to make fails here rather than pass unseen)."""

    def __init__(self, device: torch.device):  # no torch.cuda.Stream
        self.device = device

    def on_side(self):
        """No side stream: a null context."""
        return contextlib.nullcontext()

    def side_waits_for_compute(self) -> None:
        """Nothing to order."""

    def record(self) -> object:
        """A placeholder event (the manager tells CPU from CUDA by an event being None)."""
        return object()

    def compute_waits(self, event: object) -> None:
        """Nothing to wait for."""

    def used_on_side(self, t: Tensor) -> None:
        """No allocator streams."""

    def host_buffer(self, t: Tensor, pinned: bool) -> Tensor:
        """The host copy of t, on the meta device."""
        return torch.empty_like(t, device="meta")

    def device_buffer(self, host: Tensor, device: torch.device) -> Tensor:
        """A device tensor for a copy of `host` (the fake CPU device)."""
        return torch.empty_like(host, device=device)


@contextlib.contextmanager
def eager_step() -> Iterator[None]:
    """torchao's compiled optimizer step run eagerly (a compiled step cannot run on fake tensors under a mode)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def host_on_meta(model: nn.Module) -> None:
    """The model's offload manager (if any) keeps its host copies on the meta device."""
    offload = applied(model).offload
    if offload is not None:
        offload._streams = HostOnMeta(torch.device("cpu"))


def storage_bytes(t: Tensor) -> Tensor:
    """offload._storage_bytes without `set_` (which keeps a fake storage alive for ever): the whole storage
    behind t as a flat uint8 view."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((n,), (1,), 0).view(torch.uint8)


def as_view(storage_bytes: Tensor, view: tuple) -> Tensor:
    """offload._as_view without `set_`: a view (dtype, offset, shape, stride) of a flat uint8 storage."""
    dtype, offset, shape, stride = view
    return storage_bytes.view(dtype).as_strided(shape, stride, offset)


@contextlib.contextmanager
def fake_safe_offload() -> Iterator[None]:
    """Offload's storage views without `set_`, and no keyword tensor exempted (fake storages cannot be told apart
    by data pointer): the module docstring's stand-in."""
    real = engine_offload._shared_storages, engine_offload._storage_bytes, engine_offload._as_view
    engine_offload._shared_storages = lambda kwargs: set()
    engine_offload._storage_bytes, engine_offload._as_view = storage_bytes, as_view
    try:
        yield
    finally:
        engine_offload._shared_storages, engine_offload._storage_bytes, engine_offload._as_view = real
