"""Profiler-timeline check that host<->device copies overlap compute (issue #16); skips cleanly without a GPU.

  offload   memory=offload on a ~100M LLaMA at 4K: every activation-offload copy is "Pinned" (never pageable),
            runs on a stream other than the compute kernels', and most of its time overlaps compute kernels
            (the prefetch of block i-1 runs while block i's backward computes)
  batches   a training step of the real trainer on CUDA: the batch's host->device copies come from pinned memory

Reads the chrome trace torch.profiler exports (kernel / gpu_memcpy events with their stream and [ts, ts + dur]).
Usage: python bench/gpu_overlap.py --out bench/results/gpu_overlap.json   (run by bench/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIN_OVERLAP = 0.5  # share of offload copy time that must run under compute kernels


def trace_events(prof) -> list[dict]:
    """Kernel and memcpy events of a finished profiler, from its chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]


def overlap_report(events: list[dict]) -> dict:
    """Copy time, how much of it runs while a kernel on another stream runs, and the copies' memory kinds."""
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["args"].get("stream")) for e in events if e["cat"] == "kernel")
    copies = [e for e in events if e["cat"] == "gpu_memcpy"]
    total = covered = 0.0
    for c in copies:
        start, end, stream = c["ts"], c["ts"] + c["dur"], c["args"].get("stream")
        spans = sorted((max(s, start), min(t, end)) for s, t, ks in kernels if ks != stream and s < end and t > start)
        merged_end = start
        for s, t in spans:  # union of the overlapping kernel intervals
            s = max(s, merged_end)
            if t > s:
                covered += t - s
                merged_end = t
        total += end - start
    kinds: dict[str, int] = {}
    for c in copies:
        kinds[c["name"]] = kinds.get(c["name"], 0) + 1
    compute_streams = {k[2] for k in kernels}
    return {
        "copy_us": total,
        "overlapped_us": covered,
        "overlap": covered / total if total else 0.0,
        "copies": kinds,
        "copy_streams": sorted({c["args"].get("stream") for c in copies}),
        "compute_streams": sorted(compute_streams),
    }


def check_offload() -> dict:
    """Profile one offloaded step (after a warm-up step) and report the copies' overlap with compute."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexengine.applied import applied
    from flexengine.attention import patch_attention
    from flexengine.config import MemoryConfig
    from flexengine.loss import forward_loss_sum
    from flexengine.memory import apply_memory_policy

    torch.manual_seed(0)
    arch = dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_cache=False,
        max_position_embeddings=8192,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**arch)).to(torch.bfloat16).train()
    patch_attention(model, mode="packed_doc", backend="flex", compile=True)
    apply_memory_policy(model, MemoryConfig(policy="offload"))
    S = 4096
    ids = torch.randint(0, 32000, (1, S), device="cuda")
    pos = torch.cat([torch.arange(1024), torch.arange(3072)]).to("cuda")[None]
    batch = {"input_ids": ids, "labels": ids, "position_ids": pos}
    forward_loss_sum(model, batch).backward()  # warm-up: compile, allocator, pinned host cache
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward_loss_sum(model, batch).backward()
        torch.cuda.synchronize()
    report = overlap_report(trace_events(prof))
    manager = applied(model).offload
    report["pageable_bytes"] = manager.pageable_bytes
    pageable = [k for k in report["copies"] if "Pageable" in k]
    report["passed"] = (
        report["overlap"] >= MIN_OVERLAP
        and not pageable
        and not set(report["copy_streams"]) <= set(report["compute_streams"])
    )
    return report


def check_batches() -> dict:
    """One step of the real trainer on CUDA: its batch copies are Pinned -> Device."""
    from flexengine.doctor import compose_job
    from flexengine.run import build_trainer

    with tempfile.TemporaryDirectory() as tmp:
        job = compose_job(["debug=fast", "hardware=h100_80g", f"train.output_dir={tmp}"])
        trainer = build_trainer(job, Path(tmp))
        trainer.train_step()  # warm-up
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_step()
            torch.cuda.synchronize()
        trainer.metrics.close()
    copies = overlap_report(trace_events(prof))["copies"]
    h2d = {k: v for k, v in copies.items() if "HtoD" in k}
    return {"host_to_device_copies": h2d, "passed": bool(h2d) and all("Pinned" in k for k in h2d)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_overlap.json")
    args = parser.parse_args()
    results: dict = {}
    if not torch.cuda.is_available():
        results = {name: {"skipped": "no CUDA device"} for name in ("offload", "batches")}
    else:
        for name, fn in (("offload", check_offload), ("batches", check_batches)):
            try:
                results[name] = fn()
            except Exception as e:  # one failing check must not hide the other's numbers
                results[name] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    sys.exit(0 if all(r.get("passed", True) for r in results.values()) else 1)


if __name__ == "__main__":
    main()
