"""Reading a profiler timeline: do activation-offload copies overlap compute? (check `offload_overlap`)

A step's chrome trace (torch.profiler) gives every kernel and memcpy with its stream and [ts, ts + dur]. The
compute stream is the one with the most kernel time; offload copies are the memcpys on any other stream. The
verdict measures overlap against what the shape allows: overlapped copy time / min(copy time, compute time).
At hidden 1024 the copies outweigh compute ~5x, so "share of copy time overlapped" was capped near 20-30 % even
with perfect prefetch; min() makes the pass line (0.5) independent of that ratio. A pass also needs every copy
pinned (never pageable) and every host->device copy of the compute stream (the batches) pinned.

  python bench/gpu_overlap.py   # the offload_overlap check alone, on a GPU (else its synthetic CPU part)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Callable

MIN_OVERLAP_OF_POSSIBLE = 0.5  # overlapped copy time / min(copy time, compute time)


def profile_step(step: Callable[[], object]) -> list[dict]:
    """Kernel and memcpy events of one call of `step` (CUDA), from the profiler's chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    total, end = 0.0, float("-inf")
    for s, t in sorted(spans):
        s = max(s, end)
        if t > s:
            total += t - s
            end = t
    return total


def _overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time during which some interval of `a` and some interval of `b` both run."""
    return sum(_union_us([(max(s, s0), min(t, t0)) for s0, t0 in b if s0 < t and t0 > s]) for s, t in a)


def overlap_verdict(events: list[dict]) -> dict:
    """The overlap of side-stream copies with compute-stream kernels, and whether it passes."""
    kernels = [e for e in events if e["cat"] == "kernel"]
    copies = [e for e in events if e["cat"] == "gpu_memcpy"]
    by_stream: dict = {}
    for k in kernels:
        by_stream[k["args"].get("stream")] = by_stream.get(k["args"].get("stream"), 0.0) + k["dur"]
    compute = max(by_stream, key=by_stream.get) if by_stream else None
    # host<->device copies off the compute stream (a device-to-device copy is not offload traffic)
    side = [c for c in copies if c["args"].get("stream") != compute and ("DtoH" in c["name"] or "HtoD" in c["name"])]
    span = lambda e: (e["ts"], e["ts"] + e["dur"])  # noqa: E731
    compute_spans = [span(k) for k in kernels if k["args"].get("stream") == compute]
    copy_us = _union_us([span(c) for c in side])
    compute_us = _union_us(compute_spans)
    overlapped = _overlap_us(_merge([span(c) for c in side]), compute_spans)
    possible = min(copy_us, compute_us)
    kinds: dict[str, int] = {}
    for c in copies:
        kinds[c["name"]] = kinds.get(c["name"], 0) + 1
    pageable = sorted(k for k in kinds if "Pageable" in k)
    batch_h2d = sorted({c["name"] for c in copies if c["args"].get("stream") == compute and "HtoD" in c["name"]})
    reasons = []
    if not side:
        reasons.append("no copy on a side stream (offload copies run on the compute stream)")
    if side and overlapped < MIN_OVERLAP_OF_POSSIBLE * possible:
        reasons.append(
            f"overlap {overlapped / max(possible, 1e-9):.0%} of the possible < {MIN_OVERLAP_OF_POSSIBLE:.0%}"
        )
    if pageable:
        reasons.append(f"pageable copies: {pageable}")
    if any("Pinned" not in k for k in batch_h2d):
        reasons.append(f"batch copies not pinned: {batch_h2d}")
    return {
        "ok": not reasons,
        "reasons": reasons,
        "copy_us": copy_us,
        "compute_us": compute_us,
        "overlapped_us": overlapped,
        "overlap_of_copy_time": overlapped / copy_us if copy_us else 0.0,
        "overlap_of_possible": overlapped / possible if possible else 0.0,
        "side_copy_bytes": sum(int(c["args"].get("bytes", 0)) for c in side),
        "copies": kinds,
        "compute_stream": compute,
        "copy_streams": sorted({c["args"].get("stream") for c in side}),
    }


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping intervals merged (so overlap is not counted twice)."""
    out: list[list[float]] = []
    for s, t in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return [(s, t) for s, t in out]


def _event(cat: str, name: str, stream: int, ts: float, dur: float) -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "bytes": 1 << 20}}


def synthetic_timeline(variant: str) -> list[dict]:
    """A forward + backward of 4 blocks as the profiler would show it: `overlapped` (copies on stream 20 during
    the kernels of stream 7), `same_stream` (copies on the compute stream, between kernels) or `serialised`
    (a side stream, but each copy waits for compute to stop: prefetch not running ahead)."""
    events, t = [], 0.0
    pinned_d2h, pinned_h2d = "Memcpy DtoH (Device -> Pinned)", "Memcpy HtoD (Pinned -> Device)"
    events.append(_event("gpu_memcpy", pinned_h2d, 7, t, 5))  # the batch, on the compute stream
    t += 5
    for i in range(8):  # 4 forward blocks (copy out), then 4 backward blocks (copy in)
        name = pinned_d2h if i < 4 else pinned_h2d
        events.append(_event("kernel", f"block{i}", 7, t, 100))
        if variant == "overlapped":
            events.append(_event("gpu_memcpy", name, 20, t + 10, 60))
            t += 100
        else:
            events.append(_event("gpu_memcpy", name, 7 if variant == "same_stream" else 20, t + 100, 60))
            t += 160
    return events


def synthetic_demo() -> dict:
    """The verdict on the three synthetic timelines: only `overlapped` may pass."""
    cases = {
        v: {"verdict": overlap_verdict(synthetic_timeline(v))} for v in ("overlapped", "same_stream", "serialised")
    }
    for case in cases.values():
        case["verdict"] = {k: case["verdict"][k] for k in ("ok", "reasons", "overlap_of_possible")}
    ok = cases["overlapped"]["verdict"]["ok"] and not any(
        cases[v]["verdict"]["ok"] for v in ("same_stream", "serialised")
    )
    return {"ok": ok, "cases": cases}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from gpu_check_width import check_offload_overlap

    print(json.dumps(check_offload_overlap(dry=not torch.cuda.is_available()), indent=1, default=str))
