"""Rank 0 decides, every rank follows: run a step on rank 0 or on every rank, and fail on all ranks if it fails on
one (never a hang). All are no-ops around the call in a single process.

The checkpoint save and load go through these on a CPU group with its own long timeout (COLLECTIVE_TIMEOUT_S):
writing and hashing tens of GB can outlast NCCL's 10 minutes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

from flexengine.core.distributed import global_rank, global_world_size
from flexengine.core.errors import UserError, os_error_message

COLLECTIVE_TIMEOUT_S = 3 * 3600.0  # ranks wait for rank 0 to write and hash a 7B checkpoint on a slow disk


def _failure_text(e: BaseException, doing: str) -> str:
    """What another rank prints when this rank's part failed."""
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, OSError):
        return os_error_message(e, doing)
    return f"{doing} failed: {type(e).__name__}: {e}"


def run_on_rank0(group: Any, fn: Callable[[], Any], doing: str) -> Any:
    """fn() on rank 0, its result on every rank. Any exception on rank 0 is re-raised there and reaches the other
    ranks as a UserError (they never wait for a broadcast that does not come)."""
    result: Any = None
    error: Optional[BaseException] = None
    if global_rank() == 0:
        try:
            result = fn()
        except Exception as e:
            error = e
    if group is not None:
        box = [(result, None if error is None else _failure_text(error, doing))]
        dist.broadcast_object_list(box, src=0, group=group)
        result, text = box[0]
        if error is None and text is not None:
            raise UserError(f"rank 0: {text}")
    if error is not None:
        raise error
    return result


def on_every_rank(group: Any, fn: Callable[[], Any], doing: str, share: bool = False) -> Any:
    """fn() on every rank; returns this rank's result, or with `share` every rank's (a list in rank order, for
    small results). If fn raises on any rank, it raises on every rank: its own exception where it failed, a
    UserError naming the failed rank and its message elsewhere."""
    result: Any = None
    error: Optional[BaseException] = None
    try:
        result = fn()
    except Exception as e:
        error = e
    mine = (result if share else None, None if error is None else _failure_text(error, doing))
    outcomes: list[tuple[Any, Optional[str]]] = [mine]
    if group is not None:
        gathered: list[Any] = [None] * global_world_size()  # all_gather_object fills every rank's entry
        dist.all_gather_object(gathered, mine, group=group)
        outcomes = gathered
    if error is not None:
        raise error
    failed = [(r, text) for r, (_, text) in enumerate(outcomes) if text is not None]
    if failed:
        raise UserError(f"rank {failed[0][0]}: {failed[0][1]}")
    return [res for res, _ in outcomes] if share else result
