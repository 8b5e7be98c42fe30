"""train.profile: a torch.profiler trace of a few optimizer steps, so "where does the time go" has an answer.

The trace goes to <run>/tb/profile (TensorBoard's profiler plugin and chrome://tracing read it); the top ops by
self time are logged and written to <run>/profile_top_ops.txt.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from flexengine.core.storage import write_text_atomic

log = logging.getLogger(__name__)

TOP_OPS = 20


def profile_schedule(max_steps: int, profile_steps: int) -> dict:
    """wait/warmup/active step counts: skip the first step (compilation, allocator warm-up) and warm up one
    more when the run is long enough, so the recorded steps are steady-state ones."""
    active = max(1, min(profile_steps, max_steps))
    spare = max_steps - active
    return {"wait": 1 if spare >= 2 else 0, "warmup": 1 if spare >= 1 else 0, "active": active, "repeat": 1}


def top_ops_table(prof: profile, device: torch.device, row_limit: int = TOP_OPS) -> str:
    """The profiler's op table sorted by self time on the device that does the work."""
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=row_limit)


def start_profiler(out_dir: Path, max_steps: int, profile_steps: int, device: torch.device) -> profile:
    """Start a profiler; call `.step()` after every optimizer step and `.stop()` after the loop."""
    trace_dir = out_dir / "tb" / "profile"
    write_trace = tensorboard_trace_handler(str(trace_dir))

    def on_trace_ready(prof: profile) -> None:
        write_trace(prof)
        table = top_ops_table(prof, device)
        write_text_atomic(out_dir / "profile_top_ops.txt", table)  # through no link
        log.info("profile: trace in %s; top ops by self time:\n%s", trace_dir, table)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(
        activities=activities,
        schedule=schedule(**profile_schedule(max_steps, profile_steps)),
        on_trace_ready=on_trace_ready,
        record_shapes=True,
    )
    prof.start()
    return prof
