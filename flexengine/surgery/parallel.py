"""Data parallelism over torchrun with PyTorch's own engines: FSDP2 (`fully_shard`) or DDP.

The process group itself (joining the torchrun job, the rank helpers) is flexengine.core.distributed's. The model
surgery order ends here: attention -> checkpoint/offload -> compile -> `apply_parallel`.

The trainer divides each rank's summed token loss by the valid tokens of the *global* batch, so the rank
gradients must be summed, not averaged: FSDP's divide factor is set to 1 and DDP gets a summing comm hook.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator, Optional, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from flexengine.core.config import LossConfig
from flexengine.core.distributed import DistInfo, global_rank
from flexengine.core.parallel_spec import ParallelSpec, Strategy
from flexengine.surgery.applied import applied
from flexengine.surgery.family import hf_causal_lm
from flexengine.surgery.fused_loss import check_fusable_head
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import decoder_layers

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `t` is a DTensor (an FSDP2 shard): numel() is then global, its data the local shard. Duck-typed, so
    callers need no torch.distributed.tensor import and a plain-process run never loads it."""
    return hasattr(t, "to_local")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (each rank's own); other tensors as they are."""
    return t.to_local() if is_dtensor(t) else t


class LossForward(nn.Module):
    """The training forward as one module call, so FSDP/DDP hooks run around it.

    `forward_loss_sum` calls the decoder and the lm_head separately (never `model.forward`, to avoid full
    logits); a root module whose forward *is* the loss gives FSDP's root and DDP one place to hook.
    """

    def __init__(self, model: nn.Module, chunk_size: int = 0, fused: bool = False):
        super().__init__()
        self.model, self.chunk_size, self.fused = model, chunk_size, fused
        if fused:  # refused before the first step, not in it
            check_fusable_head(hf_causal_lm(model).get_output_embeddings())

    def forward(self, batch: dict, logits: bool = False, **mask_kwargs) -> torch.Tensor:
        """Summed next-token CE of the batch (see flexengine.surgery.loss); with logits=True the model's logits instead
        (greedy samples: a sharded model must be entered through this root module on every rank)."""
        if logits:
            return self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **mask_kwargs).logits
        return forward_loss_sum(self.model, batch, self.chunk_size, self.fused, **mask_kwargs)


def _allreduce_sum_hook(group, bucket):
    # DDP's default hook averages over ranks; our loss is already normalised by the global token count
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def apply_fsdp(
    root: nn.Module,
    model: nn.Module,
    parallel: ParallelSpec,
    device: torch.device,
    weights_from_rank0: bool = False,
    *,
    mesh=None,
) -> None:
    """FSDP2: fully_shard each decoder block, then the root (embeddings, final norm, lm_head), in place.

    weights_from_rank0: only rank 0 holds the real weights (the others a placeholder of the same shapes); its
    full state dict is broadcast into every rank's shards once the model is sharded. mesh: the 1-D DeviceMesh
    to shard over (context parallelism: its flattened dp x cp mesh); None = all ranks.
    """
    from torch.distributed.fsdp import fully_shard

    # rank 0's full tensors, kept alive until broadcast; every other rank contributes nothing
    full = {k: v.detach() for k, v in model.state_dict().items()} if weights_from_rank0 and global_rank() == 0 else {}

    # the precision mode decides the cast (apply_precision recorded it; a model that never had one computes in its
    # stored dtype), and the record says what was applied: the trainer's compute context asks it
    record = applied(model)
    record.fsdp_policy = (
        record.precision.fsdp_policy(device, parallel.mixed_precision) if record.precision is not None else None
    )
    kwargs = {"mp_policy": record.fsdp_policy} if record.fsdp_policy is not None else {}
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=parallel.reshard_after_forward, mesh=mesh, **kwargs)
    fully_shard(root, mesh=mesh, **kwargs)  # the root keeps its weights gathered through backward (FSDP2's default)
    for module in [*layers, root]:
        module.set_gradient_divide_factor(1.0)  # sum, not mean: see the module docstring
        module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM; factor 1 needs none)
    log.info(
        "fsdp: %d decoder blocks + root sharded over %d ranks%s",
        len(layers),
        dist.get_world_size(),
        _policy_note(record.fsdp_policy),
    )
    if weights_from_rank0:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        log.info("fsdp: weights broadcast from rank 0 into the shards (%d tensors)", len(full) if full else -1)


def _policy_note(policy: Optional[MixedPrecisionPolicy]) -> str:
    """' (bfloat16 params, float32 reduce)': the dtypes FSDP2 gathers and reduce-scatters in under `policy`, read
    from it ('' for none; a None dtype: the stored one, a None reduce dtype: the gradients', i.e. the gathered one)."""
    if policy is None:
        return ""
    gather = str(policy.param_dtype).removeprefix("torch.") if policy.param_dtype is not None else "stored"
    reduce = str(policy.reduce_dtype).removeprefix("torch.") if policy.reduce_dtype is not None else gather
    return f" ({gather} params, {reduce} reduce)"


def apply_parallel(
    model: nn.Module,
    parallel: ParallelSpec,
    info: DistInfo,
    device: torch.device,
    loss: Optional[LossConfig] = None,
    *,
    weights_from_rank0: bool = False,
    fsdp_mesh=None,
) -> nn.Module:
    """The module the trainer calls for the loss: plain, FSDP2-sharded (model changed in place) or DDP.

    weights_from_rank0: ranks > 0 built the model without reading the checkpoint (`loads_weights`); rank 0's
    weights reach them here, by broadcast (FSDP2: into the shards; DDP: its constructor broadcasts rank 0).
    fsdp_mesh: the DeviceMesh FSDP2 shards over (context parallelism's flattened dp x cp); None = all ranks.
    loss: loss.chunk_size and loss.fused (None: unchunked). lm_head is sharded with the root, whose forward is the
    loss: its weight is gathered while the fused loss reads it, as when the chunked loss calls lm_head.
    """
    loss = loss if loss is not None else LossConfig()
    root = LossForward(model, loss.chunk_size, loss.fused)
    if not dist.is_initialized():
        return root
    if parallel.strategy is Strategy.FSDP:
        apply_fsdp(root, model, parallel, device, weights_from_rank0=weights_from_rank0, mesh=fsdp_mesh)
        return root
    from torch.nn.parallel import DistributedDataParallel

    # init_sync (the default) broadcasts rank 0's parameters and buffers to every rank
    ddp = DistributedDataParallel(root, device_ids=[device.index] if device.type == "cuda" else None, init_sync=True)
    ddp.register_comm_hook(None, _allreduce_sum_hook)
    log.info("ddp: full replica on each of %d ranks", info.world_size)
    return ddp


def loads_weights(info: DistInfo) -> bool:
    """Whether this rank reads the checkpoint from disk: only rank 0 of a job (one host copy per node, not one
    per rank); the others build placeholders of the same shapes and receive rank 0's weights in apply_parallel."""
    return info.is_main


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Forward + backward of one micro-batch, reducing gradients across ranks only if `enabled` (the last
    micro-batch of an accumulation window): DDP's no_sync, FSDP2's set_requires_gradient_sync. Skipped
    reductions leave unsharded gradients accumulating locally until the window's last backward."""
    no_sync = getattr(module, "no_sync", None)  # DDP
    set_sync = getattr(module, "set_requires_gradient_sync", None)  # an FSDP2 module (the root)
    with contextlib.ExitStack() as stack:
        if not enabled and dist.is_initialized():
            if no_sync is not None:
                stack.enter_context(no_sync())
            elif set_sync is not None:
                set_sync(False)
                stack.callback(set_sync, True)
        yield


def grad_norm_value(grad_norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s result as a plain tensor (under FSDP2 it is a replicated DTensor)."""
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
