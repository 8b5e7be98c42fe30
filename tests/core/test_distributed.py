"""The process-group runtime: a plain process is rank 0 of 1 and every helper a no-op; torchrun's environment is
checked against parallel.cp before any group is joined; rank 0 goes first through a CPU group of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexengine.core.config import ParallelConfig
from flexengine.core.distributed import (
    DistInfo,
    cpu_group,
    global_rank,
    global_world_size,
    init_distributed,
    main_rank_first,
    rank_device,
    shutdown_distributed,
)
from flexengine.core.errors import UserError


@pytest.fixture
def plain_process(monkeypatch):
    """No torchrun environment and no process group (a group another test left would change every answer)."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_a_plain_process_is_rank_0_of_1_and_every_helper_is_a_no_op(plain_process):
    assert init_distributed(ParallelConfig(), torch.device("cpu")) == DistInfo()
    assert (global_rank(), global_world_size()) == (0, 1)
    with cpu_group(1.0) as group:
        assert group is None
    ran = []
    with main_rank_first(DistInfo(), timeout_s=1.0):
        ran.append(True)
    assert ran == [True]
    shutdown_distributed()  # nothing joined: nothing to leave
    assert not torch.distributed.is_initialized()


def test_context_parallel_without_torchrun_says_how_to_launch(plain_process):
    with pytest.raises(UserError, match=r"parallel.cp=2 .*torchrun --nproc_per_node <a multiple of 2>"):
        init_distributed(ParallelConfig(cp=2), torch.device("cpu"))


def test_a_world_size_cp_does_not_divide_is_refused_before_joining(plain_process, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match=r"parallel.cp=2 must divide the number of ranks \(3\)"):
        init_distributed(ParallelConfig(cp=2), torch.device("cpu"))
    assert not torch.distributed.is_initialized()


def test_the_cp_ranks_of_a_group_read_the_same_rows():
    ranks = [DistInfo(rank, 4, rank, cp=2) for rank in range(4)]
    assert [r.data_rank for r in ranks] == [0, 0, 1, 1]
    assert {r.data_world_size for r in ranks} == {2}
    assert [r.is_main for r in ranks] == [True, False, False, False]


def test_rank_device_is_the_local_gpu_or_the_cpu():
    assert rank_device(torch.device("cuda"), DistInfo(3, 4, 1)) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu"), DistInfo(3, 4, 1)) == torch.device("cpu")


def _slow_rank_0(rank: int, init_file: str, result_dir: str) -> None:
    """Rank 0 'tokenizes' for 4 s inside main_rank_first; the job's own collectives time out after 2 s."""
    import datetime
    import time

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2)
    )
    try:
        with main_rank_first(DistInfo(rank, 2, rank), timeout_s=60):
            if rank == 0:
                time.sleep(4)
        (Path(result_dir) / f"rank{rank}.ok").touch()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_wait_for_tokenization_longer_than_the_collective_timeout(tmp_path):
    """Before: ranks > 0 waited in a barrier of the job's process group (NCCL: 10 minutes), so tokenizing a large
    corpus on rank 0 killed the job. Now the wait has its own CPU group and timeout (parallel.data_timeout_s)."""
    import torch.multiprocessing as mp

    mp.spawn(_slow_rank_0, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "rank0.ok").is_file() and (tmp_path / "rank1.ok").is_file()
