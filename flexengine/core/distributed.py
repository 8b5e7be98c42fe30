"""This process's place in a torchrun job and the process-group runtime: join and leave the job, the rank helpers,
a CPU group with its own timeout, rank 0 first.

`torchrun --nproc_per_node N -m flexengine.train ...` sets RANK/WORLD_SIZE/LOCAL_RANK; `init_distributed` reads
them. run.py joins and leaves; the loop's checkpoint collectives, the model's parallel wrappers and the data's
rank-0-first cache fill read the rank helpers. Every helper is a no-op (or rank 0 of 1) in a plain process.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from flexengine.core.config import ParallelConfig
from flexengine.core.errors import UserError

log = logging.getLogger(__name__)


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


def shutdown_distributed() -> None:
    """Leave the process group (end of a torchrun job)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def global_rank() -> int:
    """This process's rank in the job (0 in a single process)."""
    return dist.get_rank() if dist.is_initialized() else 0


def global_world_size() -> int:
    """The number of processes in the job (1 in a single process)."""
    return dist.get_world_size() if dist.is_initialized() else 1


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
