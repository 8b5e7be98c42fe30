"""checkpoint/rank_sync.py over two real processes (gloo): a failure on one rank fails every rank, none hangs,
and the checkpoint's waits outlast the job's collective timeout."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from flexengine.core import storage
from flexengine.loop.checkpoint import save as checkpoint_save
from flexengine.loop.checkpoint.load import load_checkpoint_state
from flexengine.loop.checkpoint.save import save_checkpoint
from tests.helpers import make_llama


def _two_ranks(rank: int, init_file: str, out: str) -> None:
    """Each phase records how this rank ended and how long it took. The job's own collectives time out after
    3 s; the checkpoint's waits go through their own group (rank 0 hashes for 5 s in phase "slow_hash")."""
    import datetime
    import time

    import torch.distributed as dist

    from flexengine.loop.checkpoint import rank_sync

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3)
    )
    rank_sync.COLLECTIVE_TIMEOUT_S = 60.0  # a hang fails the test in a minute (the save and the load read it)
    root, model, results = Path(out) / "checkpoints", make_llama(), {}

    def phase(name, fn):
        start = time.perf_counter()
        try:
            fn()
            results[name] = ["ok", ""]
        except Exception as e:
            results[name] = [type(e).__name__, str(e)]
        results[name].append(time.perf_counter() - start)

    real_hash, real_save, real_temp = storage.sha256_file, torch.save, checkpoint_save.temp_dir_name

    def slow_hash(path):
        time.sleep(5)
        return real_hash(path)

    def rank1_cannot_write(obj, f, *args, **kwargs):
        raise OSError(errno.EACCES, "Permission denied", str(f))

    def rank0_bug(step):
        raise TypeError("a bug on rank 0")

    if rank == 0:
        storage.sha256_file = slow_hash
    phase("slow_hash", lambda: save_checkpoint(root, 1, model, None, {"train": {"step": 1}}))
    storage.sha256_file = real_hash
    if rank == 1:
        torch.save = rank1_cannot_write
    phase("rank1_write", lambda: save_checkpoint(root, 2, model, None, {"train": {"step": 2}}))
    torch.save = real_save
    if rank == 0:
        checkpoint_save.temp_dir_name = rank0_bug
    phase("rank0_bug", lambda: save_checkpoint(root, 3, model, None, {"train": {"step": 3}}))
    checkpoint_save.temp_dir_name = real_temp
    dist.barrier()
    if rank == 1:
        (root / "step_1" / "trainer_state.rank1.pt").unlink()
    dist.barrier()
    phase("rank1_load", lambda: load_checkpoint_state(root / "step_1"))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_failure_on_one_rank_fails_every_rank_without_a_hang(tmp_path):
    """Before: rank 0's hashing ran inside a wait on the job's group (NCCL: 10 minutes), a non-UserError on
    rank 0 (OSError, a bug) left the other ranks waiting for a broadcast that never came, and the checkpoint load
    had no agreement step (a missing rank file failed one rank while the others went on into collectives)."""
    import torch.multiprocessing as mp

    mp.spawn(_two_ranks, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["slow_hash"][0] == r1["slow_hash"][0] == "ok"  # 5 s of hashing outlasts the 3 s job timeout
    manifest = json.loads((tmp_path / "checkpoints" / "step_1" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and "trainer_state.rank1.pt" in manifest["files"]  # each rank's file
    assert r1["rank1_write"][0] == "UserError"
    assert r1["rank1_write"][1].startswith(f"saving a checkpoint failed at {tmp_path}/checkpoints/.tmp_step_2_")
    assert r1["rank1_write"][1].endswith(
        "/trainer_state.rank1.pt: Permission denied; check its permissions, or "
        "choose a directory you can write (e.g. train.output_dir=...)."
    )
    assert r0["rank1_write"][0] == "UserError" and r0["rank1_write"][1].startswith("rank 1: saving a checkpoint")
    assert r0["rank0_bug"][:2] == ["TypeError", "a bug on rank 0"]  # its own exception, with its traceback
    assert r1["rank0_bug"][0] == "UserError" and "rank 0: preparing" in r1["rank0_bug"][1]
    assert r1["rank1_load"][0] == "UserError" and "trainer_state.rank1.pt is missing" in r1["rank1_load"][1]
    assert r0["rank1_load"][0] == "UserError" and r0["rank1_load"][1].startswith("rank 1: ")
    for name in ("rank1_write", "rank0_bug", "rank1_load"):
        assert r0[name][2] < 20 and r1[name][2] < 20, name  # seconds: no rank waited for a timeout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]  # no partial save left
