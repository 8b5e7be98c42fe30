"""Run metrics: TensorBoard scalars under stable tags + metrics.jsonl, FLOPs utilisation arithmetic, peak memory and
the CUDA caching allocator's own figures."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

# Stable TensorBoard tags (other tools and tests read them back).
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "useful_tokens_per_s": "perf/useful_tokens_per_s",
    "mfu": "perf/mfu",  # model FLOPs utilisation (flexengine.loop.flops)
    "hfu": "perf/hfu",  # hardware FLOPs utilisation: executed FLOPs, recompute and padding included
    "peak_memory_bytes": "memory/peak_bytes",
    "useful_token_fraction": "data/useful_token_fraction",
    # fraction of a causal mask's blocks the document mask computes (FlexAttention's "sparsity" is 1 - this)
    "block_density": "attn/block_density",
    # the step's seconds against the plan's (loop/progress.py: the ratio is the measured median so far / planned)
    "step_s": "perf/step_s",
    "planned_step_s": "perf/planned_step_s",
    "step_time_ratio": "perf/step_time_ratio",
}

# What the CUDA caching allocator holds (torch.cuda.memory_stats), logged on CUDA only: on CPU there is no such
# allocator and these keys are null in summary.json and absent from metrics.jsonl and TensorBoard.
ALLOCATOR_TAGS = {
    "max_memory_allocated_bytes": "memory/max_allocated_bytes",  # peak bytes in live tensors
    "max_memory_reserved_bytes": "memory/max_reserved_bytes",  # peak bytes the allocator held from the card
    # reserved minus allocated at their peaks: fragmentation and cached free blocks, which the planner's tensor
    # bytes do not see and its margin must absorb
    "allocator_overhead_bytes": "memory/allocator_overhead_bytes",
    "num_alloc_retries": "memory/alloc_retries",  # cudaMalloc failed, the cache was freed and the call retried
    "num_ooms": "memory/ooms",  # out-of-memory errors the allocator raised
}

_TRAIN_TAGS = {**TAGS, **ALLOCATOR_TAGS}


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def allocator_stats(device: torch.device) -> dict:
    """The ALLOCATOR_TAGS figures since the process started (or the last peak reset); all None off CUDA. A host-side
    read of the allocator's counters: no device sync."""
    if device.type != "cuda":
        return dict.fromkeys(ALLOCATOR_TAGS)
    stats = torch.cuda.memory_stats(device)  # max_memory_allocated/_reserved read these same peaks
    allocated = int(stats.get("allocated_bytes.all.peak", 0))
    reserved = int(stats.get("reserved_bytes.all.peak", 0))
    return {
        "max_memory_allocated_bytes": allocated,
        "max_memory_reserved_bytes": reserved,
        "allocator_overhead_bytes": reserved - allocated,
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
    }


def utilization(flops: float, seconds: float, peak_tflops: Optional[float]) -> Optional[float]:
    """FLOPs / seconds as a fraction of the device's peak (None when the peak is unknown)."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)


class MetricsWriter:
    """TensorBoard writer that knows our tag names, plus metrics.jsonl (one JSON object per logged step and per
    evaluation); a no-op off rank 0."""

    def __init__(self, log_dir: Optional[Path], jsonl_path: Optional[Path] = None):
        self.writer = None
        self.jsonl_path = jsonl_path
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict, step: int, kind: str = "train") -> None:
        """Log each metric: train keys under their stable tag (unknown ones under `extra/`), other kinds under
        `<kind>/<key>` (eval/loss, eval/ppl); the same values go to metrics.jsonl as {"type": kind, "step", ...}."""
        values = {k: v for k, v in values.items() if v is not None}
        if self.writer is not None:
            for key, value in values.items():
                tag = _TRAIN_TAGS.get(key, f"extra/{key}") if kind == "train" else f"{kind}/{key}"
                self.writer.add_scalar(tag, float(value), step)
        self.record({"type": kind, "step": step, **values})

    def record(self, record: dict) -> None:
        """Append one JSON object to metrics.jsonl (non-finite floats as null: JSON has no NaN)."""
        if self.jsonl_path is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(clean) + "\n")

    def text(self, tag: str, text: str, step: int) -> None:
        """A text entry (TensorBoard's TEXT tab)."""
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def truncate_after(self, step: int) -> None:
        """Drop metrics.jsonl records past `step` (a resumed run repeats the steps after its checkpoint)."""
        if self.jsonl_path is None or not self.jsonl_path.is_file():
            return
        lines = self.jsonl_path.read_text().splitlines()
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            self.jsonl_path.write_text("".join(line + "\n" for line in kept))

    def section(self, prefix: str, values: dict, step: int) -> None:
        """Log the numeric entries of a report under `<prefix>/<key>` (e.g. the packing report at step 0)."""
        if self.writer is None:
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", float(value), step)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """Hyper-parameters for TensorBoard's HPARAMS tab (compare runs of a sweep)."""
        if self.writer is None:
            return
        clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
        self.writer.add_hparams(clean, {f"hparam/{k}": float(v) for k, v in metrics.items()}, run_name=".")

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()
