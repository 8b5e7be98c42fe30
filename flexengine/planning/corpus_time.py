"""How long a corpus takes: the planner's step time times the optimizer steps the packed rows need, for the plan a
run would take and for the alternatives a user weighs before renting hardware (full fine-tune vs LoRA, one card vs
a node of them).

Every number here is an estimate: the step time is the planner's, priced with this machine's measured speed when
the plan is for the device it runs on (core/device_speed), else with a named card's datasheet peak at an assumed MFU
(flexengine/planning/costs.py); each row names its source. Where the device's speed is unknown there are no hours
(no number is better than a wrong one): the table says so and names the options that give one. The rows come from
the caller (the packed plan of the real documents, or of documents of one length), so packing's padding is
counted, not assumed away. `flexengine-doctor` measures the epoch from real steps instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexengine.planning.costs import NO_SPEED, UNKNOWN
from flexengine.planning.fit import FitPlan


@dataclass(frozen=True)
class Corpus:
    """What is to be trained on, in packed rows: rows of one epoch, the tokens in them that are not padding, and
    how many epochs."""

    rows: int
    useful_tokens: int
    epochs: float = 1.0
    describe: str = ""  # where the numbers come from (the data, or the lengths assumed)


def corpus_row(label: str, fit: FitPlan, corpus: Corpus, *, world_size: int, cp: int, lora_r: int) -> dict:
    """One alternative's row (cli/plan_corpus.corpus_hours plans each): its fit on `world_size` devices (cp of them
    share a row), with steps, step time, useful tokens/s and hours over the corpus."""
    best = fit.plan.chosen
    rows_per_step = best.micro_batch * best.grad_accum * max(1, world_size // cp)
    steps = math.ceil(corpus.rows * corpus.epochs / rows_per_step)
    known = best.time.source != UNKNOWN  # an unknown speed ranks policies, but is no time
    seconds = steps * best.time.step_s if known else None
    return {
        "label": label,
        "world_size": world_size,
        "lora_r": lora_r,
        "fits": best.usage.fits,
        "precision": fit.precision.name,
        "policy": best.label,
        "micro_batch": best.micro_batch,
        "grad_accum": best.grad_accum,
        "rows_per_step": rows_per_step,
        "steps": steps,
        "step_s": best.time.step_s if known else None,
        "useful_tokens_per_s": corpus.useful_tokens * corpus.epochs / seconds if seconds else None,
        "hours": seconds / 3600 if seconds is not None else None,
        "time_source": best.time.source,
    }


def format_corpus_hours(rows: list[dict], corpus: Corpus, hardware_name: str) -> str:
    """The table flexengine-plan prints: one line per alternative, labelled as the estimate it is and its source."""
    sources = sorted({r["time_source"] for r in rows if r["hours"] is not None})
    head = (
        f"how long: {corpus.describe}; {corpus.epochs:g} epoch(s) on {hardware_name} (estimates: the planner's step "
        f"time from {' / '.join(sources) if sources else 'no known speed'}, not a measured run)"
    )
    columns = (
        f"  {'':<26} {'devs':>4} {'precision':<16} {'policy':<24} {'rows/step':>9} {'steps':>7} {'s/step':>7} "
        f"{'useful tok/s':>12} {'hours':>7}"
    )
    lines = [head, columns]
    for r in rows:
        fits = "" if r["fits"] else "  (does not fit)"
        step = f"{r['step_s']:>7.2f}" if r["step_s"] is not None else f"{'n/a':>7}"
        rate = f"{r['useful_tokens_per_s']:>12,.0f}" if r["useful_tokens_per_s"] is not None else f"{'n/a':>12}"
        hours = f"{r['hours']:>7.1f}" if r["hours"] is not None else f"{'n/a':>7}"
        lines.append(
            f"  {r['label']:<26} {r['world_size']:>4} {r['precision']:<16} {r['policy'][:24]:<24} "
            f"{r['rows_per_step']:>9} {r['steps']:>7,} {step} {rate} {hours}{fits}"
        )
    if any(r["hours"] is None for r in rows):
        lines.append(f"  {NO_SPEED}")
    return "\n".join(lines)
