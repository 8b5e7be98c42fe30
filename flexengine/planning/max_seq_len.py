"""How long can a row be? The longest data.seq_len that fits the card under each memory policy (the planner's
bytes model, searched), with the estimated step time there, and memory-vs-length curves for a plot.

Every term of the bytes model grows with the row length, so "fits" is monotone in it and a bisection over
multiples of `step` tokens (the FlexAttention block, 128; x cp under context parallelism, whose rows must split
into whole blocks per rank) finds the boundary exactly.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from flexengine.core.config import CP_BLOCK_SIZE, HardwareConfig, OptimConfig, PrecisionConfig
from flexengine.core.extras import require
from flexengine.core.units import GiB
from flexengine.planning.activations import memory_specs
from flexengine.planning.planner import candidates_for, evaluate, offloads
from flexengine.planning.shapes import AttendedPairs, ModelShape, PlanInputs
from flexengine.planning.specs import PlanSpecs, plan_inputs
from flexengine.surgery.precision import auto_order, precision_spec

MAX_SEARCH_TOKENS = 1 << 24  # 16M tokens: past any card's memory for a 1B+ model

PairsAt = Callable[[int], AttendedPairs]  # the attended pairs of a row of this many tokens (a window's share shrinks)


def at_length(x: PlanInputs, seq_len: int, pairs_at: Optional[PairsAt] = None) -> PlanInputs:
    """The inputs at another row length, with the attention pairs counted for that length when `pairs_at` says
    how (else x's own count, a share of seq_len^2 that holds only for masks without a window)."""
    pairs = pairs_at(seq_len) if pairs_at is not None else x.pairs
    return dataclasses.replace(x, seq_len=seq_len, pairs=pairs)


def longest_fitting(m: ModelShape, x: PlanInputs, memory, pairs_at: Optional[PairsAt] = None) -> int:
    """The longest seq_len (a multiple of `step`, 128 x cp) whose step fits under `memory`; 0 if not even `step`
    does."""
    step = CP_BLOCK_SIZE * x.cp

    def fits(n: int) -> bool:
        return evaluate(m, at_length(x, n * step, pairs_at), memory).usage.fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * step <= MAX_SEARCH_TOKENS and fits(hi):
        lo, hi = hi, hi * 2
    if hi * step > MAX_SEARCH_TOKENS:
        return lo * step
    # fits(lo), not fits(hi): the longest is the one before the first of lo + 1 .. hi - 1 that does not fit
    return (lo + bisect.bisect_left(range(lo + 1, hi), True, key=lambda n: not fits(n))) * step


def max_seq_len_table(
    hf_config, x: PlanInputs, tiled_mlp: Any = "auto", pairs_at: Optional[PairsAt] = None
) -> list[dict]:
    """Per candidate policy: the longest fitting seq_len, and the step time, tokens/s, recompute share and
    host traffic at that length (x.micro_batch rows per micro-batch; attention pairs by `pairs_at`)."""
    m = ModelShape.from_hf_config(hf_config)
    rows = []
    for label, memory in candidates_for(tiled_mlp):
        if x.hardware.on_cpu and offloads(memory_specs(memory, m)):
            continue  # on a CPU "device" offloading saves nothing
        n = longest_fitting(m, x, memory, pairs_at)
        row = {"label": label, "max_seq_len": n}
        if n:
            at = evaluate(m, at_length(x, n, pairs_at), memory)
            row.update(
                memory=dataclasses.asdict(at.memory),
                total_bytes=at.usage.terms.total_bytes,
                step_s=at.time.step_s,
                tokens_per_s=x.micro_batch * n / at.time.step_s,
                offloaded_bytes=at.usage.offloaded_bytes,
                host_bytes=at.usage.host_bytes,
                recompute_flops_fraction=at.time.recompute_flops_fraction,
                time_source=at.time.source,  # planning/costs: MEASURED, ASSUMED or UNKNOWN (no time to print)
            )
        rows.append(row)
    return rows


def longest_over_modes(
    specs_by_rank: Mapping[int, PlanSpecs],
    hf_config,
    hardware: HardwareConfig,
    precision: PrecisionConfig,
    optim: OptimConfig,
    *,
    tiled_mlp: Any = "auto",
    pairs_at: Optional[PairsAt] = None,
) -> list[dict]:
    """The longest row per (LoRA rank, precision mode), each mode searched over every policy as the memory search
    searches them: one row each with the mode, the policy that reaches it and what the host holds there (host
    optimizer state plus offloaded activations), and whether precision=auto may take the mode (it trains correctly).
    specs_by_rank: the job's PlanSpecs at each LoRA rank. Modes: precision.mode, or under auto the ones auto weighs
    on this device."""
    modes = [precision.mode] if precision.mode != "auto" else list(auto_order(hardware.on_cuda, optim.name))
    out = []
    for r, specs in specs_by_rank.items():
        for mode in modes:
            spec = precision_spec(mode, optim.name)
            rows = max_seq_len_table(hf_config, plan_inputs(specs, hardware, spec), tiled_mlp, pairs_at=pairs_at)
            best = max(rows, key=lambda row: row["max_seq_len"])
            out.append(
                {
                    "lora_r": r,
                    "precision": mode,
                    "trains_correctly": spec.trains_correctly,
                    **{k: v for k, v in best.items() if k != "label"},
                    "policy": best["label"],
                }
            )
    return out


def longest_of(modes: Sequence[dict], lora_r: int) -> Optional[dict]:
    """The longest row of `longest_over_modes` at this LoRA rank among the modes that train correctly."""
    rows = [row for row in modes if row["lora_r"] == lora_r and row["trains_correctly"] and row["max_seq_len"]]
    return max(rows, key=lambda row: row["max_seq_len"], default=None)


def memory_curves(
    hf_config, x: PlanInputs, lengths: list[int], tiled_mlp: Any = "auto", pairs_at: Optional[PairsAt] = None
) -> dict[str, list[float]]:
    """Total bytes (GiB) per candidate policy at each seq_len in `lengths`."""
    m = ModelShape.from_hf_config(hf_config)
    return {
        label: [evaluate(m, at_length(x, n, pairs_at), memory).usage.terms.total_bytes / GiB for n in lengths]
        for label, memory in candidates_for(tiled_mlp)
        if not x.hardware.on_cpu or not offloads(memory_specs(memory, m))
    }


def plot_memory_vs_seq_len(
    curves: dict[str, list[float]], lengths: list[int], budget_gib: float, path: Path, title: str
) -> None:
    """Log-log plot of total memory per policy against seq_len, with the card's budget."""
    matplotlib = require("matplotlib", "plan.png (the memory plot)", "plan.png=null for the table alone")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, gib) in enumerate(curves.items()):  # 10 colours, then dashed: 11+ policies stay distinct
        ax.plot(lengths, gib, marker=".", label=label, color=f"C{i % 10}", linestyle="-" if i < 10 else "--")
    ax.axhline(
        budget_gib, color="black", linestyle="--", label=f"budget {budget_gib:.1f} GiB (card - CUDA context - margin)"
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data.seq_len (tokens)")
    ax.set_ylabel("planned memory per device (GiB)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
