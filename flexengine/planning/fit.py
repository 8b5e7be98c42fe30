"""Fit before allocating: resolve hardware, precision, memory policy and micro-batch from the planner, for every
training run, from the HF config alone (no weight exists yet), or stop with an error that says what would fit.

`precision=auto` takes the fastest estimated step among the modes that fit and train correctly
(PrecisionSpec.trains_correctly: the long-horizon numerics check), the more exact one on a tie; `memory=auto` the
policy with the cheapest estimated step (recompute FLOPs plus exposed PCIe time) over k = 0..L checkpointed blocks,
granularity, offload and micro-batch (flexengine.planning.planner). Explicit choices are kept, and checked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from flexengine.core.config import HardwareConfig, JobConfig, MemoryConfig, PrecisionConfig
from flexengine.core.errors import UserError
from flexengine.core.memory_policies import MEMORY_POLICIES
from flexengine.core.parallel_spec import ReduceEvery, resolve_parallel
from flexengine.core.units import GiB
from flexengine.planning.costs import COMPILE_S, UNKNOWN, interconnect_gb_s
from flexengine.planning.plan import Candidate, Plan
from flexengine.planning.planner import k_table, offloads, plan_memory, policy_family
from flexengine.planning.shapes import AttendedPairs, ModelShape
from flexengine.planning.specs import PlanSpecs, plan_inputs, planned_attention, whole_row_pairs
from flexengine.surgery.attention.spec import AttentionSpec
from flexengine.surgery.family import resolve_family
from flexengine.surgery.precision import (
    PrecisionSpec,
    auto_order,
    check_updates_arrive,
    optimizer_missing,
    precision_spec,
)

log = logging.getLogger(__name__)

TIE_FRACTION = 0.01  # step estimates this close are a tie, which the more exact mode wins (the estimate is no finer)


@dataclass(frozen=True)
class PrecisionTrial:
    """One precision mode the fit planned: its plan's answer, its numerics, and precision=auto's verdict on it."""

    precision: str
    fits: bool
    total_bytes: int
    host_bytes: int
    policy: str
    step_s: float
    updates_exact: bool
    stochastic_rounding: bool
    trains_correctly: bool
    missing: str  # the package its optimizer needs and this environment lacks; "" when it can be built
    why_not_fit: str  # which budget the plan overruns, "" when it fits
    verdict: str = ""  # why precision=auto took it, or why it lost (set once every mode is planned)
    time_source: str = UNKNOWN  # where step_s comes from (planning/costs): an unknown speed's ranks, prints n/a

    def to_json(self) -> dict[str, object]:
        """The row as the plan's JSON writes it."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FitPlan:
    """The resolved choices of one run and the plan behind them."""

    hardware: HardwareConfig  # concrete: device, memory_gb, host_memory_gb filled in
    precision: PrecisionSpec
    plan: Plan  # planner output under the chosen precision
    precision_table: tuple[PrecisionTrial, ...] = ()  # every mode tried: fits, device and host bytes, verdict


def plan_job(
    job: JobConfig,
    hf_config,
    hardware: HardwareConfig,
    *,
    attention: Optional[AttentionSpec] = None,
    pairs: Optional[AttendedPairs] = None,
) -> FitPlan:
    """Plan `job` on concrete `hardware` (see flexengine.core.hardware): precision, memory policy and micro-batch.
    attention: the AttentionSpec the caller resolved (None: attn.* resolved for `hardware`'s device); pairs: the
    attended-pair count of the corpus's packed rows (None: each layer's mask over one whole-row document)."""
    on_cuda = hardware.on_cuda
    attention = attention if attention is not None else planned_attention(job.attn, hf_config, hardware)
    specs = plan_specs(job, hf_config, attention, pairs)
    modes = [job.precision.mode] if job.precision.mode != "auto" else auto_order(on_cuda, job.optim.name)
    table, plans = [], []
    for mode in modes:
        spec = precision_spec(mode, job.optim.name)
        x = plan_inputs(specs, hardware, spec)
        plan = plan_memory(hf_config, x, given=job.memory, search_micro_batch=job.memory.policy == "auto")
        best = plan.chosen
        table.append(
            PrecisionTrial(
                precision=mode,
                fits=best.usage.fits,
                total_bytes=best.usage.terms.total_bytes,
                host_bytes=best.usage.host_bytes,
                policy=best.label,
                step_s=best.time.step_s,
                updates_exact=spec.updates_exact,
                stochastic_rounding=spec.stochastic_rounding,
                trains_correctly=spec.trains_correctly,
                missing=optimizer_missing(spec.optimizer),  # precision=auto skips what cannot be built here
                why_not_fit=_why_not_fit(plan),
                time_source=best.time.source,
            )
        )
        plans.append((spec, plan))
    timed = on_cuda and comparable_times(table)  # a measured mode is never ranked against an unknown one
    chosen = choose_precision(table, timed=timed)
    spec, plan = plans[chosen]
    return FitPlan(hardware, spec, plan, with_verdicts(table, chosen, timed=timed))


def plan_specs(job: JobConfig, hf_config, attention: AttentionSpec, pairs: Optional[AttendedPairs] = None) -> PlanSpecs:
    """The PlanSpecs of a job on its model, with the AttentionSpec the composition root resolved; pairs: a known
    corpus's packed rows' count (None: each layer's mask over one whole-row document, `whole_row_pairs`)."""
    lora = job.model.lora
    fraction = None
    if lora.r > 0:  # only adapters have grads and optimizer states
        shape, family = ModelShape.from_hf_config(hf_config), resolve_family(hf_config)
        fraction = shape.lora_params(lora.r, family.lora_targets_of(lora.target_modules), family) / shape.params
    return PlanSpecs(
        seq_len=job.data.seq_len,
        micro_batch=job.train.micro_batch,
        grad_accum=job.train.grad_accum,
        chunk_size=job.loss.chunk_size,
        attention=attention,
        parallel=resolve_parallel(job.parallel),
        lora_fraction=fraction,
        pairs=pairs if pairs is not None else whole_row_pairs(attention, job.data.seq_len),
        compiled=job.train.compile,
        fused_loss=job.loss.fused,
    )


def comparable_times(rows: Sequence[PrecisionTrial]) -> bool:
    """Whether the fitting modes' step times are one known source's (all measured, or all assumed MFU x peak):
    only then does precision=auto rank them by time."""
    sources = {r.time_source for r in rows if r.fits}
    return len(sources) <= 1 and UNKNOWN not in sources


def _untimed_reason(rows: Sequence[PrecisionTrial]) -> str:
    """Why precision=auto did not rank these modes by step time."""
    sources = sorted({r.time_source for r in rows if r.fits})
    if len(sources) > 1:
        return f"step times from {' and '.join(sources)} are not comparable"
    return "this device's speed is unknown" if UNKNOWN in sources else "no CPU step-time model"


def step_cell(seconds: float, source: str, width: int, digits: int) -> str:
    """A step time as a table cell: n/a where the device's speed is unknown (its figure only ranks)."""
    return f"{'n/a':>{width}}" if source == UNKNOWN else f"{seconds:>{width}.{digits}f}"


def choose_precision(rows: Sequence[PrecisionTrial], timed: bool = True) -> int:
    """The row precision=auto takes (rows most exact first): the fastest estimated step among the modes that fit
    and train correctly (and whose optimizer this environment can build), the more exact on a tie (within
    TIE_FRACTION); if none fits, the leanest correct mode, whose plan's suggestions say what would. A single
    explicit mode is taken as given.

    timed=False (CPU): the most exact mode that fits. The planner's step time has no CPU compute model (no peak
    FLOPs, and bf16 matmuls are no faster than fp32 on most CPUs), so its differences there are only the modelled
    transfer terms: over gloo, bf16 gradients' smaller all-reduce made bf16_sr "faster" on 2 ranks while one
    process took fp32, and the two runs of one job diverged."""
    correct = [i for i, r in enumerate(rows) if r.trains_correctly and not r.missing]
    correct = correct or list(range(len(rows)))
    fitting = [i for i in correct if rows[i].fits]
    if not fitting:
        return min(correct, key=lambda i: rows[i].total_bytes)
    if not timed:
        return fitting[0]
    fastest = min(rows[i].step_s for i in fitting)
    return next(i for i in fitting if rows[i].step_s <= fastest * (1 + TIE_FRACTION))


def precision_verdicts(fit: FitPlan) -> list[str]:
    """precision=auto's weighing, one line per mode (none for a single given mode)."""
    if len(fit.precision_table) < 2:
        return []
    return [
        f"precision={r.precision:<16} {_secs(r.step_s) if r.time_source != UNKNOWN else 'n/a':>9}/step  {r.verdict}"
        for r in fit.precision_table
    ]


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 else f"{s:.2g} s"  # a tiny CPU model's step is milliseconds


def _why_not_fit(plan: Plan) -> str:
    """Which budget a plan overruns, in GiB ("" when it fits)."""
    usage = plan.chosen.usage
    if usage.fits:
        return ""
    if usage.terms.total_bytes > usage.budget.usable_bytes or not usage.host_budget_bytes:
        return f"{_gib(usage.terms.total_bytes)} GiB > {_gib(usage.budget.usable_bytes)} GiB"
    return f"host {_gib(usage.host_bytes)} GiB > {_gib(usage.host_budget_bytes)} GiB"


def with_verdicts(rows: Sequence[PrecisionTrial], chosen: int, timed: bool = True) -> tuple[PrecisionTrial, ...]:
    """The rows with their `verdict`: why precision=auto took each, or why it lost to the chosen row."""
    return tuple(dataclasses.replace(r, verdict=_verdict(rows, i, chosen, timed)) for i, r in enumerate(rows))


def _verdict(rows: Sequence[PrecisionTrial], i: int, chosen: int, timed: bool) -> str:
    """Why precision=auto took row i, or why it lost to the chosen row."""
    best, r = rows[chosen], rows[i]
    vs = f"{best.precision}'s {_secs(best.step_s)}"
    if i == chosen:
        return "chosen" if best.fits else f"leanest, and does not fit: {r.why_not_fit}"
    if not r.trains_correctly:
        return "fails the long-horizon numerics check (small updates round away)"
    if r.missing:
        return f"needs {r.missing}, not installed (pip install {r.missing})"
    if not r.fits:
        return f"does not fit: {r.why_not_fit}"
    if i > chosen and not timed:
        return f"less exact: the most exact mode that fits wins ({_untimed_reason(rows)})"
    if i > chosen and r.step_s <= best.step_s * (1 + TIE_FRACTION):
        return f"ties with {vs} (within {TIE_FRACTION:.0%}): the more exact mode wins"
    return f"slower: {_secs(r.step_s)} vs {vs}"


def _explicit_choices(job: JobConfig) -> list[str]:
    """The precision/memory settings the user fixed (the planner did not choose them)."""
    out = [f"precision={job.precision.mode}"] if job.precision.mode != "auto" else []
    if job.memory.policy != "auto":
        return out + [f"memory={job.memory.policy}"]
    return out + [
        f"memory.{key}={getattr(job.memory, key)}"
        for key in ("layers", "granularity", "offload")
        if getattr(job.memory, key) is not None
    ]


def _what_fits(job: JobConfig, hf_config, hardware: HardwareConfig, attention: Optional[AttentionSpec]) -> list[str]:
    """For an explicit choice that does not fit: the choices that would (memory=auto's search)."""
    auto = dataclasses.replace(job, memory=MemoryConfig(policy="auto"), precision=PrecisionConfig("auto"))
    fit = plan_job(auto, hf_config, hardware, attention=attention)
    if not fit.plan.chosen.usage.fits:
        return list(fit.plan.suggestions)
    ranked = sorted((r for r in fit.plan.candidates if r.usage.fits), key=lambda r: r.time.step_s)[:4]
    return [
        f"precision={fit.precision.name} {_overrides(r)} ({_gib(r.usage.terms.total_bytes)} GiB, "
        f"~{r.time.step_s:.1f} s/step)"
        for r in ranked
    ]


def _overrides(row: Candidate) -> str:
    """The command-line overrides that select a candidate."""
    mem = row.memory
    policy = MEMORY_POLICIES[mem.policy]
    parts = [f"memory={mem.policy}", f"memory.layers={mem.layers}" if policy.chooses_blocks else ""]
    parts.append(f"memory.granularity={mem.granularity}" if policy.recomputes and policy.granularity is None else "")
    parts.append("memory.offload=true" if mem.offload else "")  # (only a policy that offloads inputs has it)
    parts.append(f"train.micro_batch={row.micro_batch} train.grad_accum={row.grad_accum}")
    return " ".join(p for p in parts if p)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def check_fit(job: JobConfig, fit: FitPlan, hf_config, attention: AttentionSpec) -> None:
    """Log a run's fit of `job` (flexengine/resolve.py) and raise UserError naming what would fit when it does not, or
    when optim.lr's updates would round away in the stored weights."""
    hardware = fit.hardware
    # one line in the run's log; the whole table with hydra.verbose=flexengine.planning.fit, or from flexengine-plan
    log.info("plan: %s", format_fit_summary(fit))
    for line in precision_verdicts(fit):  # precision=auto: one line per mode (the summary has each in short)
        log.debug("plan: %s", line)
    log.debug("plan:\n%s", format_fit(fit))
    if not fit.plan.chosen.usage.fits:
        explicit = _explicit_choices(job)
        what = _what_fits(job, hf_config, hardware, attention) if explicit else list(fit.plan.suggestions)
        usage = fit.plan.chosen.usage
        raise UserError(
            f"{' '.join(explicit) or 'this run'} does not fit {hardware.name}: a {_gib(usage.terms.total_bytes)} GiB "
            f"peak against {usage.budget.describe()} (hardware.memory_margin_gb sets the margin), "
            f"{_gib(usage.host_bytes)} GiB of {_gib(usage.host_budget_bytes)} GiB host memory "
            f"(precision={fit.precision.name}, {fit.plan.chosen.label}). "
            "What would fit:\n  " + "\n  ".join(what)
        )
    check_updates_arrive(fit.precision, job.optim.lr)
    hint = compile_hint(job, fit)
    if hint:
        log.info("plan: %s", hint)
    best = fit.plan.chosen
    if best.micro_batch != job.train.micro_batch:
        log.warning(
            "memory=auto: train.micro_batch %d -> %d, train.grad_accum %d -> %d (same rows per optimizer "
            "step; the cheaper plan). Set memory=<policy> to keep train.micro_batch as given.",
            job.train.micro_batch,
            best.micro_batch,
            job.train.grad_accum,
            best.grad_accum,
        )


def compile_hint(job: JobConfig, fit: FitPlan) -> str:
    """With train.compile=false on a GPU: what eager pointwise ops cost over the run against compiling once, when
    compiling pays (costs.eager_pointwise_s, COMPILE_S); else ''."""
    eager_s = fit.plan.chosen.time.eager_pointwise_s
    if job.train.compile or fit.hardware.on_cpu or eager_s * job.train.max_steps <= COMPILE_S:
        return ""
    return (
        f"train.compile=true would pay: eager blocks run their pointwise ops unfused, ~{eager_s:.2f} s of each "
        f"~{fit.plan.chosen.time.step_s:.1f} s step ({eager_s * job.train.max_steps / 60:.0f} min over "
        f"{job.train.max_steps} steps) against ~{COMPILE_S / 60:.0f} min to compile the blocks' shared graph once"
    )


def format_fit(fit: FitPlan) -> str:
    """The plan as text: budgets, the precision modes tried, and the k -> memory / recompute table."""
    p, best = fit.plan, fit.plan.chosen
    usage, hw = best.usage, fit.hardware
    lines = [
        (
            f"hardware {hw.name} ({hw.device}): {usage.budget.describe()} on the device, "
            f"{_gib(usage.host_budget_bytes)} GiB host; seq_len={p.seq_len} micro_batch={best.micro_batch} "
            f"grad_accum={best.grad_accum}"
        )
    ]
    if len(fit.precision_table) > 1 or (fit.precision_table and not fit.precision_table[0].fits):
        lines.append(
            f"  {'precision':<16} {'device GiB':>10} {'host GiB':>9} {'step s':>7} {'fits':>5}  {'best policy':<26}  "
            "precision=auto"
        )
        for t in fit.precision_table:
            step = step_cell(t.step_s, t.time_source, 7, 1)
            lines.append(
                f"  {t.precision:<16} {_gib(t.total_bytes):>10} {_gib(t.host_bytes):>9} "
                f"{step} {'yes' if t.fits else 'no':>5}  {t.policy:<26}  {t.verdict}"
            )
    lines.append(
        f"  {'k (of ' + str(p.hf_config.get('num_hidden_layers')) + ')':<8} {'policy':<26} "
        f"{'device GiB':>10} {'recompute':>9} {'PCIe s':>7} {'step s':>7} {'fits':>5}"
    )
    for r in k_table(p):
        mark = "  <- chosen" if r.label == best.label else ""
        lines.append(
            f"  {r.k:<8} {r.label:<26} {_gib(r.usage.terms.total_bytes):>10} "
            f"{100 * r.time.recompute_flops_fraction:>8.1f}% {r.time.offload_exposed_s:>7.2f} "
            f"{step_cell(r.time.step_s, best.time.source, 7, 2)} {'yes' if r.usage.fits else 'no':>5}{mark}"
        )
    terms = " + ".join(f"{k.removesuffix('_bytes')} {_gib(v)}" for k, v in usage.terms.items() if v)
    lines.append(
        f"chosen: precision={fit.precision.name}, {best.label}, micro_batch={best.micro_batch} x "
        f"grad_accum={best.grad_accum}: {terms} = {_gib(usage.terms.total_bytes)} GiB peak of "
        f"{_gib(usage.budget.usable_bytes)} GiB budget; "
        f"host {_gib(usage.host_bytes)} of {_gib(usage.host_budget_bytes)} GiB"
        + ("" if usage.fits else "  -- DOES NOT FIT")
    )
    lines.append(pairs_line(p.attention_pairs))
    if hw.world_size > 1 and best.grad_accum > 1:
        lines.append(_reduce_line(p, hw))
    if offloads(best.specs):
        bound = usage.offload_pinned_bound_bytes  # None only without a host budget (then offload's default)
        if bound is not None:
            lines.append(
                f"offload: at most {_gib(bound)} GiB of pinned host memory per rank (host budget "
                f"{_gib(usage.host_budget_bytes)} GiB less host optimizer state)"
            )
    return "\n".join(lines)


def pairs_line(pairs: AttendedPairs) -> str:
    """Where the step time's attention pair count comes from (the plan's `attention_pairs`)."""
    share = pairs.as_dict()["fraction_of_row_squared"]
    return f"attention: {share:.3f} x seq_len^2 (query, key) pairs per row and layer, from {pairs.source}"


RUNNERS_UP = 2


def _step_phrase(plan: Plan) -> str:
    """'~1.23 s/step (measured device speed)', or no number where the device's speed is unknown."""
    time = plan.chosen.time
    if time.source == UNKNOWN:
        return "step time unknown (no device speed: hardware=<card> plans a named card, hardware=auto measures here)"
    return f"~{time.step_s:.2f} s/step ({time.source})"


def format_fit_summary(fit: FitPlan) -> str:
    """The plan in one line: the chosen configuration, the precision modes tried, and the cheapest runners-up of
    other policy families (what a training run logs; flexengine-plan prints the whole table)."""
    p, best = fit.plan, fit.plan.chosen
    usage = best.usage
    chosen = (
        f"precision={fit.precision.name}, {best.label}, micro_batch={best.micro_batch} x grad_accum={best.grad_accum}: "
        f"{_gib(usage.terms.total_bytes)} GiB peak of {usage.budget.describe()}, host {_gib(usage.host_bytes)} of "
        f"{_gib(usage.host_budget_bytes)} GiB, {_step_phrase(p)}" + ("" if usage.fits else " -- DOES NOT FIT")
    )
    if len(fit.precision_table) > 1:
        chosen += (
            " (precision=auto weighed: "
            + ", ".join(f"{t.precision} {_short_verdict(t.verdict)}" for t in fit.precision_table)
            + ")"
        )
    families, runners = {(policy_family(best.specs), best.micro_batch)}, []
    fitting = (r for r in p.candidates if r.usage.fits)
    for r in sorted(fitting, key=lambda r: (r.time.cost, r.k, r.usage.terms.total_bytes)):
        family = policy_family(r.specs), r.micro_batch  # another k of the same policy is not worth naming
        if family in families:
            continue
        families.add(family)
        step = f"~{r.time.step_s:.2f} s/step" if best.time.source != UNKNOWN else "step time unknown"  # no fallback s
        runners.append(f"{r.label} ({_gib(r.usage.terms.total_bytes)} GiB, {step})")  # labels say mb=
        if len(runners) == RUNNERS_UP:
            break
    return chosen + ("; runners-up: " + "; ".join(runners) if runners else "") + "; full table: flexengine-plan"


def _short_verdict(verdict: str) -> str:
    """A precision verdict's head ("ties with fp32's 0.3 s", "slower", "does not fit"), for the one-line summary."""
    return verdict.split(":")[0].split(" (")[0]


def _reduce_line(p: Plan, hw: HardwareConfig) -> str:
    """FSDP's gradient reduce-scatter: which one the plan took, its traffic, and the other one's cost."""
    best, time = p.chosen, p.chosen.time
    same = (r for r in p.candidates if r.memory == best.memory and r.micro_batch == best.micro_batch)
    other = next((r for r in same if r.time.reduce_every != time.reduce_every), None)
    every = "every micro-batch" if time.reduce_every is ReduceEvery.MICRO_BATCH else "once per accumulation window"
    line = (
        f"gradients: reduce-scatter {every} (parallel.reduce_every={time.reduce_every.value}): "
        f"{time.reduce_scatter_bytes_per_step / 1e9:.1f} GB sent per rank per step, "
        f"{time.reduce_scatter_s:.2f} s at {interconnect_gb_s(hw):g} GB/s (hardware.interconnect_gb_s; an estimate "
        f"unless set), {time.reduce_exposed_s:.2f} s not hidden by backward"
    )
    if other is not None:
        unsharded = other.usage.terms.fsdp_unsharded_grads_bytes or 0
        line += (
            f"; the other ({other.time.reduce_every.value}): {_gib(other.usage.terms.total_bytes)} GiB with unsharded "
            f"grads {_gib(unsharded)} GiB, {other.time.step_s:.2f} s/step{'' if other.usage.fits else ', does not fit'}"
        )
    return line
