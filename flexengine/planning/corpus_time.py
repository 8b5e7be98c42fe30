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

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from flexengine.core.config import HardwareConfig, JobConfig
from flexengine.planning.costs import NO_SPEED, UNKNOWN
from flexengine.planning.resolve import resolve
from flexengine.planning.shapes import AttendedPairs
from flexengine.surgery.attention.spec import AttentionSpec

LORA_RANK = 16  # the LoRA alternative's rank when the job has none (a common choice for 7B fine-tunes)
NODE = 8  # the other card count weighed when the job plans one card: a node of them


@dataclass(frozen=True)
class Corpus:
    """What is to be trained on, in packed rows: rows of one epoch, the tokens in them that are not padding, and
    how many epochs."""

    rows: int
    useful_tokens: int
    epochs: float = 1.0
    describe: str = ""  # where the numbers come from (the data, or the lengths assumed)


def corpus_hours(
    job: JobConfig,
    hf_config,
    hardware: HardwareConfig,
    corpus: Corpus,
    *,
    attention: Optional[AttentionSpec] = None,
    pairs: Optional[AttendedPairs] = None,
) -> list[dict]:
    """One row per alternative: the job as planned, then full fine-tune vs LoRA on 1 and NODE cards (each planned
    for its precision, memory policy and micro-batch), with steps, step time, useful tokens/s and hours.
    attention, pairs: as `resolve` takes them (the corpus's packed rows' attended pairs, when known)."""
    rows = []
    for label, variant, hw in _alternatives(job, hardware):
        fit = resolve(variant, hf_config, hw, attention=attention, pairs=pairs).fit
        data_ranks = max(1, hw.world_size // variant.parallel.cp)
        rows_per_step = fit.plan.chosen.micro_batch * fit.plan.chosen.grad_accum * data_ranks
        steps = math.ceil(corpus.rows * corpus.epochs / rows_per_step)
        known = fit.plan.chosen.time.source != UNKNOWN  # an unknown speed ranks policies, but is no time
        seconds = steps * fit.plan.chosen.time.step_s if known else None
        rows.append(
            {
                "label": label,
                "world_size": hw.world_size,
                "lora_r": variant.model.lora.r,
                "fits": fit.plan.chosen.usage.fits,
                "precision": fit.precision.name,
                "policy": fit.plan.chosen.label,
                "micro_batch": fit.plan.chosen.micro_batch,
                "grad_accum": fit.plan.chosen.grad_accum,
                "rows_per_step": rows_per_step,
                "steps": steps,
                "step_s": fit.plan.chosen.time.step_s if known else None,
                "useful_tokens_per_s": corpus.useful_tokens * corpus.epochs / seconds if seconds else None,
                "hours": seconds / 3600 if seconds is not None else None,
                "time_source": fit.plan.chosen.time.source,
            }
        )
    return rows


def _alternatives(job: JobConfig, hardware: HardwareConfig) -> list[tuple[str, JobConfig, HardwareConfig]]:
    """(label, job, hardware): the job as configured first, then each of full / LoRA x 1 / NODE cards it is not.
    On more cards the accumulation shrinks so the rows per optimizer step stay the job's where they divide (the
    same optimization, done faster), as one would rerun it."""
    lora_r = job.model.lora.r or LORA_RANK
    counts = sorted({hardware.world_size, 1, NODE}) if hardware.on_cuda else [hardware.world_size]
    out = [("as configured", job, hardware)]
    for r in (0, lora_r):
        for n in counts:
            if (r, n) == (job.model.lora.r, hardware.world_size):
                continue
            accum = max(1, round(job.train.grad_accum * hardware.world_size / n))
            variant = dataclasses.replace(
                job,
                model=dataclasses.replace(job.model, lora=dataclasses.replace(job.model.lora, r=r)),
                train=dataclasses.replace(job.train, grad_accum=accum),
            )
            unit = "GPU" if hardware.on_cuda else "CPU"  # the device the rows are planned for, never "GPU" on CPU
            label = f"{'LoRA r=' + str(r) if r else 'full fine-tune'}, {n} {unit}{'s' if n > 1 else ''}"
            out.append((label, variant, dataclasses.replace(hardware, world_size=n)))
    return out


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
