"""Run metrics: TensorBoard scalars under stable tags + metrics.jsonl, FLOPs utilisation arithmetic, peak memory and
the CUDA caching allocator's own figures."""

from __future__ import annotations

import json
import logging
import math
import resource
import secrets
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from flexengine.core.storage import open_output, refuse_link, write_text_atomic

log = logging.getLogger(__name__)

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
    evaluation); a no-op off rank 0. The event file is made at the first value logged, not at construction: a run
    refused before it trains (a resume onto other data) leaves no event file in the run's tb/."""

    def __init__(self, log_dir: Optional[Path], jsonl_path: Optional[Path] = None):
        self.log_dir = log_dir
        self._writer: Any = None
        self.jsonl_path = jsonl_path

    @property
    def writer(self) -> Any:
        """The SummaryWriter (None off rank 0), made on first use in a tb/ that is no link."""
        if self._writer is None and self.log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            refuse_link(self.log_dir)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # an unguessable name: an event file is opened with "wb" by a writer that follows links, so no link
            # can be planted under the name it will open
            suffix = f".{secrets.token_hex(4)}"
            self._writer = SummaryWriter(log_dir=str(self.log_dir), filename_suffix=suffix)
        return self._writer

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
        with open_output(self.jsonl_path, "a") as f:
            f.write(json.dumps(clean) + "\n")

    def text(self, tag: str, text: str, step: int) -> None:
        """A text entry (TensorBoard's TEXT tab)."""
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def truncate_after(self, step: int) -> None:
        """Drop metrics.jsonl records past `step` (a resumed run repeats the steps after its checkpoint), and any
        line that is not a JSON record (a power cut or a full disk leaves the last one cut), each named in a
        warning."""
        if self.jsonl_path is None or not self.jsonl_path.is_file():
            return
        refuse_link(self.jsonl_path)
        text = self.jsonl_path.read_text(errors="replace")
        records = _json_records(self.jsonl_path, text)
        kept = [line for line, record in records if record.get("step", 0) <= step]
        new_text = "".join(line + "\n" for line in kept)
        if new_text != text:  # past records, torn lines, or a last line without its newline
            write_text_atomic(self.jsonl_path, new_text)

    def section(self, prefix: str, values: dict, step: int) -> None:
        """Log the numeric entries of a report under `<prefix>/<key>` (e.g. the packing report at step 0)."""
        if self.writer is None:
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", float(value), step)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        """Hyper-parameters for TensorBoard's HPARAMS tab (compare runs of a sweep), in the run's own event file:
        SummaryWriter.add_hparams opens a second writer whose file name is predictable (no link check there)."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
        values = {f"hparam/{k}": float(v) for k, v in metrics.items()}
        for summary in hparams_summaries(clean, values):  # experiment, session start, session end
            self.writer.file_writer.add_summary(summary)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()


def _json_records(path: Path, text: str) -> list[tuple[str, dict]]:
    """(line, record) of each JSON object line of an append-only log (`text`, read from `path`); a line that is not
    one (cut by a crash, overwritten) is dropped with a warning naming the file and the line, never a traceback."""
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            log.warning(
                "%s:%d is not a JSON record (cut by a crash or a full disk?): dropped: %.80r", path, number, line
            )
            continue
        records.append((line, record))
    return records
