"""The doctor's questions about time: does the step take what the plan said (and if not, which term is likely
off), and how long is one epoch of the job's corpus at the measured step. Verdicts in the doctor's form
(cli/doctor.py lists them among its checks)."""

from __future__ import annotations

import math
import statistics

from flexengine.core.config import JobConfig
from flexengine.loop.hooks import PHASES as STEP_PHASES
from flexengine.planning.costs import UNKNOWN

PHASES = (*STEP_PHASES, "other")
RATIO_LIMIT = 0.25  # a measured step this far from the planned one (either way) is flagged


def step_time_numbers(trainer, measured: list[dict]) -> dict:
    """The measured step (median of the diagnosed steps) against the plan's, by phase and term, and one epoch of
    the job's corpus at the measured step (this rank's micro-batches per epoch / grad_accum, at least one step)."""
    planned = trainer.progress.planned
    step_s = statistics.median(s["time_s"] for s in measured)
    phases = {p: statistics.median(s["phases"][p] for s in measured) for p in PHASES}
    steps_per_epoch = max(1, math.ceil(trainer.loader.batches_per_epoch / trainer.setup.train.grad_accum))
    return {
        "measured_s": step_s,
        "planned_s": planned.step_s if planned is not None else None,
        "planned_source": planned.source if planned is not None else None,
        "ratio": step_s / planned.step_s if planned is not None and planned.step_s else None,
        "planned_terms_s": dict(planned.terms) if planned is not None else {},
        "phases_s": phases,
        "steps_per_epoch": steps_per_epoch,
        "epoch_s": steps_per_epoch * step_s,  # measured on this machine, not planned
    }


def likely_term(t: dict) -> str:
    """The planned term the measured step departs from most: the phases against the terms they run (forward +
    backward: matmuls, attention, pointwise ops, the loss and recompute; the optimizer phase: the optimizer step;
    data, mask and the rest: host syncs and data, which the plan prices at 0)."""
    terms, phases = t["planned_terms_s"], t["phases_s"]
    compute = sum(terms.get(k, 0.0) for k in ("matmul", "attention", "pointwise", "loss", "recompute"))
    excess = {
        "compute": phases["forward"] + phases["backward"] - compute - terms.get("exposed_transfers", 0.0),
        "optimizer": phases["optimizer"] - terms.get("optimizer", 0.0),
        "host": phases["data"] + phases["mask"] + phases["other"],
    }
    worst = max(excess, key=lambda k: abs(excess[k]))
    if worst == "optimizer":
        return "the optimizer step"
    if worst == "host":
        return "host syncs (data loading, mask building, the gradient norm and the step's one sync)"
    if terms.get("exposed_transfers", 0.0) > 0:
        return "exposed transfers (offload traffic compute does not hide)"
    if terms.get("recompute", 0.0) > 0.1 * compute:
        return "recompute"
    if terms.get("attention", 0.0) > 0.25 * compute:
        return "attention"
    return "the matmuls (the device's measured speed: a machine under other load runs slower than it measured)"


def step_time_check(job: JobConfig, n: dict) -> dict:
    """The measured step against the planned one: beyond RATIO_LIMIT either way, the likely term named."""
    t = n["step_time"]
    if t["ratio"] is None or t["planned_source"] == UNKNOWN:
        why = "no plan to compare with" if t["ratio"] is None else "the plan's seconds rest on an unknown device speed"
        return verdict_row("step time vs plan", "info", f"{t['measured_s']:.2f} s measured ({why})")
    value = (
        f"{t['measured_s']:.2f} s measured vs {t['planned_s']:.2f} s planned ({t['ratio']:.2f}x; planned from "
        f"{t['planned_source']})"
    )
    if abs(t["ratio"] - 1) <= RATIO_LIMIT:
        return verdict_row("step time vs plan", "ok", value)
    slower = "slower" if t["ratio"] > 1 else "faster"
    term = likely_term(t)
    return verdict_row(
        "step time vs plan",
        "warn",
        value,
        f"the step runs {slower} than planned; the likely term: {term}",
        f"the planner's seconds are off by {abs(t['ratio'] - 1):.0%} here, most likely in {term}: check it in "
        "bench/planner_time.py's terms",
    )


def epoch_check(job: JobConfig, n: dict) -> dict:
    """How long one epoch of the job's corpus takes at the measured step (this machine, these settings)."""
    t = n["step_time"]
    return verdict_row(
        "epoch time",
        "info",
        f"{_hours(t['epoch_s'])} per epoch of this corpus ({t['steps_per_epoch']:,} steps x {t['measured_s']:.2f} s, "
        "measured here)",
        "from the measured step, not the planner: flexengine-plan plan.epochs=N gives the planned alternatives",
    )


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def verdict_row(name: str, verdict: str, value: str, detail: str = "", suggestion: str = "") -> dict:
    """One row of the doctor's checks: its verdict (ok / warn / ...), the value measured and what to do."""
    return {"name": name, "verdict": verdict, "value": value, "detail": detail, "suggestion": suggestion}
