"""Data parallelism over torchrun with PyTorch's own engines: FSDP2 (`fully_shard`) or DDP.

`torchrun --nproc_per_node N -m flexengine.train ...` sets RANK/WORLD_SIZE/LOCAL_RANK; `init_distributed` reads
them. The model surgery order ends here: attention -> checkpoint/offload -> compile -> `apply_parallel`.

The trainer divides each rank's summed token loss by the valid tokens of the *global* batch, so the rank
gradients must be summed, not averaged: FSDP's divide factor is set to 1 and DDP gets a summing comm hook.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from flexengine.core.config import ParallelConfig
from flexengine.core.errors import UserError
from flexengine.surgery.applied import applied
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import decoder_layers

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

log = logging.getLogger(__name__)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (an FSDP2 shard): numel() is then global, its data the local shard. Duck-typed, so
    callers need no torch.distributed.tensor import and a plain-process run never loads it."""
    return hasattr(t, "to_local")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (each rank's own); other tensors as they are."""
    return t.to_local() if is_dtensor(t) else t


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    cp: int = 1  # context parallel degree: consecutive groups of cp ranks share their rows

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, summaries and TensorBoard."""
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which share of the rows this rank reads (its data-parallel group; the cp ranks of a group split them)."""
        return self.rank // self.cp

    @property
    def data_world_size(self) -> int:
        """Data-parallel groups: each reads its own rows."""
        return self.world_size // self.cp


def init_distributed(parallel: ParallelConfig, device: torch.device) -> DistInfo:
    """Join the torchrun job described by the environment (a no-op for a plain `python -m` process).

    Under torchrun even one process joins a process group and is sharded, so a 1-GPU FSDP run (the GPU smoke
    check) exercises the same path as a node.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if parallel.cp > 1:
            raise UserError(
                f"parallel.cp={parallel.cp} splits rows over several processes: launch with "
                f"torchrun --nproc_per_node <a multiple of {parallel.cp}> -m flexengine.train ..."
            )
        return DistInfo()
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size % parallel.cp:
        raise UserError(
            f"parallel.cp={parallel.cp} must divide the number of ranks ({world_size}): launch "
            f"torchrun --nproc_per_node with a multiple of {parallel.cp}."
        )
    info = DistInfo(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")), parallel.cp)
    backend = parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    log.info(
        "distributed: rank %d/%d (local %d), backend %s, strategy %s%s",
        info.rank,
        world_size,
        info.local_rank,
        backend,
        parallel.strategy,
        f", context parallel x{info.cp}" if info.cp > 1 else "",
    )
    return info


def rank_device(device: torch.device, info: DistInfo) -> torch.device:
    """The device of this rank: cuda:<local_rank> on GPUs, the CPU otherwise."""
    return torch.device("cuda", info.local_rank) if device.type == "cuda" else device


class LossForward(nn.Module):
    """The training forward as one module call, so FSDP/DDP hooks run around it.

    `forward_loss_sum` calls the decoder and the lm_head separately (never `model.forward`, to avoid full
    logits); a root module whose forward *is* the loss gives FSDP's root and DDP one place to hook.
    """

    def __init__(self, model: nn.Module, chunk_size: int = 0):
        super().__init__()
        self.model, self.chunk_size = model, chunk_size

    def forward(self, batch: dict, logits: bool = False, **mask_kwargs) -> torch.Tensor:
        """Summed next-token CE of the batch (see flexengine.surgery.loss); with logits=True the model's logits instead
        (greedy samples: a sharded model must be entered through this root module on every rank)."""
        if logits:
            return self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **mask_kwargs).logits
        return forward_loss_sum(self.model, batch, self.chunk_size, **mask_kwargs)


def _allreduce_sum_hook(group, bucket):
    # DDP's default hook averages over ranks; our loss is already normalised by the global token count
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def apply_fsdp(
    root: nn.Module,
    model: nn.Module,
    parallel: ParallelConfig,
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
    parallel: ParallelConfig,
    info: DistInfo,
    device: torch.device,
    chunk_size: int = 0,
    *,
    weights_from_rank0: bool = False,
    fsdp_mesh=None,
) -> nn.Module:
    """The module the trainer calls for the loss: plain, FSDP2-sharded (model changed in place) or DDP.

    weights_from_rank0: ranks > 0 built the model without reading the checkpoint (`loads_weights`); rank 0's
    weights reach them here, by broadcast (FSDP2: into the shards; DDP: its constructor broadcasts rank 0).
    fsdp_mesh: the DeviceMesh FSDP2 shards over (context parallelism's flattened dp x cp); None = all ranks.
    """
    root = LossForward(model, chunk_size)
    if not dist.is_initialized():
        return root
    if parallel.strategy == "fsdp":
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
    if enabled or not dist.is_initialized():
        yield
        return
    no_sync = getattr(module, "no_sync", None)  # DDP
    if no_sync is not None:
        with no_sync():
            yield
        return
    set_sync = getattr(module, "set_requires_gradient_sync", None)  # an FSDP2 module (the root)
    if set_sync is None:
        yield
        return
    set_sync(False)
    try:
        yield
    finally:
        set_sync(True)


def global_rank() -> int:
    """This process's rank in the job (0 in a single process)."""
    return dist.get_rank() if dist.is_initialized() else 0


def global_world_size() -> int:
    """The number of processes in the job (1 in a single process)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (a no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def main_rank_first(info: DistInfo, timeout_s: float = 7200.0) -> Iterator[None]:
    """Rank 0 runs the block first (e.g. fills the tokenizer cache), the other ranks after it (cache hits).

    The wait goes through a CPU (gloo) group with its own `timeout_s`: tokenizing a large corpus can take longer
    than NCCL's default 10-minute collective timeout, which must stay short for real hangs in training.
    """
    with cpu_group(timeout_s) as group:
        if group is not None and not info.is_main:
            dist.barrier(group=group)
        yield
        if group is not None and info.is_main:
            dist.barrier(group=group)


@contextlib.contextmanager
def cpu_group(timeout_s: float) -> Iterator[Optional[dist.ProcessGroup]]:
    """A gloo group of every rank with its own timeout, for waits that may outlast the job's collective timeout
    (NCCL's 10 minutes must stay short for real hangs in training); None in a single process. Every rank must
    enter it (creating a group is itself collective); it is destroyed at the end of the block."""
    if not dist.is_initialized():
        yield None
        return
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def shutdown_distributed() -> None:
    """Leave the process group (end of a torchrun job)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def grad_norm_value(grad_norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s result as a plain tensor (under FSDP2 it is a replicated DTensor)."""
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
