"""`python -m flexengine.plan ... plan.max_seq_len=true [plan.png=maxlen.png]`: how long can a row be? Per memory
policy the longest data.seq_len that fits at the precision fit picks, then per precision mode and for full
fine-tuning and LoRA the longest over every policy (which mode and policy reach it, what the host must hold there),
with memory-vs-length curves as a PNG.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Optional

from flexengine.core.config import JobConfig
from flexengine.core.units import GiB


def gib(n: float) -> str:
    """A byte count as the plan tables' 8-wide GiB column."""
    return f"{n / GiB:8.2f} GiB"


def _step(row: dict, digits: int) -> str:
    """A row's planned step as a 12-character cell: seconds, or n/a where the device's speed is unknown (the
    planner's fallback figure ranks policies but is no time)."""
    from flexengine.planning.costs import UNKNOWN

    return f"{'n/a':>12}" if row.get("time_source") == UNKNOWN else f"{row['step_s']:>11.{digits}f}s"


def step_time_footer(rows: list[dict]) -> list[str]:
    """Where the step times come from, named per source (the README's A100 transcript: the assumed MFU)."""
    from flexengine.planning.costs import ASSUMED, ASSUMED_MFU, MEASURED, NO_SPEED, UNKNOWN

    sources = {r["time_source"] for r in rows if r.get("max_seq_len")}
    lines = []
    if ASSUMED in sources:
        lines.append(
            f"step time: the planner's FLOPs at {ASSUMED_MFU:.0%} MFU plus exposed offload traffic (an estimate, "
            "not a measurement)"
        )
    if MEASURED in sources:
        lines.append(
            "step time: the planner's FLOPs and bytes at this device's measured speed plus exposed offload traffic "
            "(an estimate from measured rates, not a measured step)"
        )
    if UNKNOWN in sources:
        lines.append(f"step time n/a: {NO_SPEED}")
    return lines


DEFAULT_PNG = "plan_max_seq_len.png"


def max_seq_len_png(png: Optional[str]) -> Optional[Path]:
    """Where to draw the memory plot, checked before the search: a path the user gave stops now without matplotlib
    (not after minutes of searching); the default picture is left out with a note, and the table still prints."""
    from flexengine.core.extras import install_command, installed, require

    if not png:
        return None
    if png == DEFAULT_PNG and not installed("matplotlib"):
        print(
            f"plan.png: the memory plot is left out (matplotlib is not installed: {install_command('matplotlib')})",
            file=sys.stderr,
        )
        return None
    require("matplotlib", f"plan.png={png} (the memory plot)", "plan.png=null for the table alone")
    return Path(png)


def build_max_seq_len(job: JobConfig, png: Optional[Path]) -> dict:
    """plan.max_seq_len=true: per policy the longest seq_len that fits, its step time; memory curves (+ PNG)."""
    from flexengine.cli.plan_corpus import LORA_RANK
    from flexengine.planning.budget import device_budget
    from flexengine.planning.max_seq_len import (
        longest_over_modes,
        max_seq_len_table,
        memory_curves,
        plot_memory_vs_seq_len,
    )
    from flexengine.planning.specs import whole_row_pairs
    from flexengine.resolve import resolve_planned, with_lora_rank
    from flexengine.surgery.rope import context_limits

    # auto: no documents, so the policy table's precision is the fit's at the supported context
    run = resolve_planned(job)
    job, hf_config, hardware = run.planned, run.hf_config, run.hardware
    attention, precision = run.attention, run.precision
    x = run.inputs(batch_of=job)  # the table at the job's own micro-batch, as given; x.cp: parallel.cp
    cp = x.cp
    tiled = job.memory.tiled_mlp or "auto"

    pairs_at = partial(whole_row_pairs, attention)  # each length's own count: a window's share of n^2 shrinks

    rows = max_seq_len_table(hf_config, x, tiled, pairs_at=pairs_at)
    ranks = sorted({0, job.model.lora.r or LORA_RANK})  # full fine-tuning and LoRA, whichever the job is
    specs = {r: run.specs(with_lora_rank(job, r)) for r in ranks}
    modes = longest_over_modes(specs, hf_config, hardware, job.precision, job.optim, tiled_mlp=tiled, pairs_at=pairs_at)
    longest = max((r["max_seq_len"] for r in rows), default=0)
    lengths = [2**k for k in range(10, max(11, (2 * max(longest, 1024) - 1).bit_length()))]
    curves = memory_curves(hf_config, x, lengths, tiled, pairs_at=pairs_at)
    budget = device_budget(x.hardware)
    report = {
        "model": job.model.name,
        "hardware": job.hardware.name,
        "world_size": x.hardware.world_size,
        "cp": cp,
        "micro_batch": x.micro_batch,
        "dtype_bytes": x.dtype_bytes,
        "trainable_fraction": x.trainable_fraction,
        "budget_bytes": budget.usable_bytes,
        "budget": budget.describe(),
        "precision": precision.name,
        "policies": rows,
        "modes": modes,  # the longest row per (LoRA rank, precision mode), over every policy
        "lengths": lengths,
        "curves_gib": curves,
        "context": context_limits(hf_config).describe(),
    }
    if png is not None:
        lora = f", LoRA r={job.model.lora.r}" if job.model.lora.r else ", full fine-tune"
        cp_label = f", context parallel x{cp}" if cp > 1 else ""
        title = f"{job.model.name} on {job.hardware.name} x{x.hardware.world_size}{lora}{cp_label}"
        plot_memory_vs_seq_len(curves, lengths, budget.usable_bytes / GiB, png, title)
        report["png"] = str(png)
    return report


def format_max_seq_len(report: dict) -> str:
    """The max_seq_len report as a table."""
    from flexengine.planning.costs import UNKNOWN

    head = f"  {'policy':<28} {'max seq_len':>12} {'total':>14} {'step (est.)':>12} {'tokens/s':>10} {'recompute':>10}"
    lines = [
        (
            f"longest data.seq_len per memory policy: {report['model']} on {report['hardware']} "
            f"(x{report['world_size']}, context parallel x{report['cp']}), micro_batch={report['micro_batch']}, "
            f"budget {report['budget']}"
        ),
        "",
        head,
    ]
    for r in report["policies"]:
        if not r["max_seq_len"]:
            lines.append(f"  {r['label']:<28} {'-':>12}   (not even 128 tokens fit)")
            continue
        rate = "n/a" if r.get("time_source") == UNKNOWN else f"{r['tokens_per_s']:,.0f}"
        lines.append(
            f"  {r['label']:<28} {r['max_seq_len']:>12,} {gib(r['total_bytes']):>14} {_step(r, 2)} "
            f"{rate:>10} {100 * r['recompute_flops_fraction']:>9.1f}%"
        )
    best = max(report["policies"], key=lambda r: r["max_seq_len"])
    lines += [
        "",
        f"longest with precision={report['precision']}: {best['max_seq_len']:,} tokens with {best['label']}",
        "",
        format_longest_over_modes(report["modes"]),
        "",
        f"model {report['context']} (rows past it need model.rope_scaling, or documents within it)",
        *step_time_footer(report["policies"] + report["modes"]),
    ]
    if "png" in report:
        lines.append(f"memory vs seq_len: {report['png']}")
    return "\n".join(lines)


def format_longest_over_modes(modes: list[dict]) -> str:
    """The longest row per (LoRA rank, precision mode), and per rank the longest a mode that trains correctly
    reaches: the mode, the policy, and what the host must hold there."""
    from flexengine.planning.max_seq_len import longest_of

    lines = [
        "longest data.seq_len per precision mode (every memory policy searched):",
        f"  {'':<16} {'precision':<16} {'max seq_len':>12} {'device':>10} {'host':>10} {'step (est.)':>12}  policy",
    ]
    for row in modes:
        what = f"LoRA r={row['lora_r']}" if row["lora_r"] else "full fine-tune"
        if not row["max_seq_len"]:
            lines.append(f"  {what:<16} {row['precision']:<16} {'-':>12}   (not even 128 tokens fit)")
            continue
        note = "" if row["trains_correctly"] else "  (fails the long-horizon numerics check: precision=auto skips it)"
        lines.append(
            f"  {what:<16} {row['precision']:<16} {row['max_seq_len']:>12,} {row['total_bytes'] / GiB:>6.1f} GiB "
            f"{row['host_bytes'] / GiB:>6.1f} GiB {_step(row, 0)}  {row['policy']}{note}"
        )
    for r in sorted({row["lora_r"] for row in modes}):
        top = longest_of(modes, r)
        if top is not None:
            lines.append(
                f"longest, {'LoRA r=' + str(r) if r else 'full fine-tune'}: {top['max_seq_len']:,} tokens with "
                f"precision={top['precision']} and {top['policy']}; the host holds {top['host_bytes'] / GiB:.1f} GiB "
                f"({(top['host_bytes'] - top['offloaded_bytes']) / GiB:.1f} GiB of optimizer state and masters, "
                f"{top['offloaded_bytes'] / GiB:.1f} GiB of offloaded activations)"
            )
    return "\n".join(lines)
