"""data.seq_len=auto: the row length with the least estimated epoch time over a corpus's documents.

Each candidate length packs the documents as training packs them (data/packing.py), counts the attention pairs
of those rows, and is planned like a run (precision, memory policy, micro-batch: `PlanAt`); its epoch is the
planned optimizer steps the rows need times the planned step. The fastest candidate that fits the device, keeps
the model's context guard (no document piece past the positions it supports: surgery/rope.check_context) and keeps
documents whole wins.

Keeping documents whole is a rule, not a cost: splitting a document cuts the context its later tokens see, which
changes what is learned, and the time alone would favour it (rows of 4,096 over documents of 6,000 tokens are
planned faster than rows of 6,144). So lengths below what holds KEEP_WHOLE of the documents are weighed and shown,
but taken only when no longer one fits.

Candidates: the document-length quantiles, powers of two and 1.5 x powers of two above the keep-whole length, the
model's trained and supported context; each rounded up on a grid of 1/16 of the power of two below it (multiples of
128, the FlexAttention block, and of cp x 128): a length at most 6.25 % past the quantile, and a dozen candidates
(each a planner search of several seconds at 7B) rather than hundreds of 128-token steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from flexengine.core.config import CP_BLOCK_SIZE, HardwareConfig
from flexengine.core.errors import UserError
from flexengine.planning.costs import ASSUMED, NO_SPEED, UNKNOWN
from flexengine.planning.fit import FitPlan
from flexengine.planning.shapes import AttendedPairs
from flexengine.planning.specs import packed_pairs
from flexengine.surgery.attention.spec import AttentionSpec
from flexengine.surgery.rope import ContextLimits

KEEP_WHOLE = 0.99  # the share of documents a row must hold whole (the rest are split per data.long_docs)
QUANTILES = (0.5, 0.9, 0.99, 1.0)  # document-length quantiles tried as row lengths
GRID_BITS = 4  # a length rounds up to a multiple of 2^(floor(log2 n) - GRID_BITS): <= 6.25 % past it
ABOVE_KEEP_WHOLE = 4  # longer rows tried up to this many times the keep-whole length (packing fills them)
MAX_ROW_TOKENS = 1 << 20  # past any card's memory for a 1B+ model
TIE_BAND = 0.01  # lengths within 1 % of the least epoch time tie, the shortest taken: the estimate is not finer
# than that (a measured speed's noise, the MFU assumed), and ranks or a plan and its run must not flip between them

# The documents packed at a row length, as data/packing.packer packs them (the composition root hands it down: the
# planner does not reach into data): the packing's statistics (rows, useful_token_fraction, documents_split /
# _truncated / _dropped, longest_piece) and each row as its document pieces' lengths
Pack = Callable[[int], tuple[Any, list[list[int]]]]
# The job planned at a row length with its packed rows' attended pairs: fit.plan_job, built in the composition root
PlanAt = Callable[[int, AttendedPairs], FitPlan]


@dataclass(frozen=True)
class Documents:
    """The documents data.seq_len=auto chooses a row length over: their token lengths, how they pack, and where
    they come from (the choice's log line)."""

    lengths: Sequence[int] | np.ndarray
    pack: Pack
    describe: str = ""
    epochs: float = 1.0  # the passes the epoch time is weighed for


def on_grid(n: int, block: int) -> int:
    """n rounded up to a multiple of `block` and of 2^(floor(log2 n) - GRID_BITS)."""
    n = max(int(n), block)
    grain = max(block, 1 << max(0, n.bit_length() - 1 - GRID_BITS))
    grain = math.lcm(grain, block)
    return -(-n // grain) * grain


def keep_whole_length(lengths: Sequence[int] | np.ndarray, block: int) -> int:
    """The shortest grid length holding KEEP_WHOLE of the documents whole."""
    return on_grid(int(np.quantile(np.asarray(lengths), KEEP_WHOLE, method="higher")), block)


def candidate_lengths(lengths: Sequence[int] | np.ndarray, block: int, limits: Optional[ContextLimits]) -> list[int]:
    """The row lengths weighed for documents of these lengths (module docstring), ascending."""
    lengths = np.asarray(lengths)
    whole = keep_whole_length(lengths, block)
    out = {whole, on_grid(whole // 2, block)}  # one shorter: the table shows what splitting would save
    out.update(on_grid(int(q), block) for q in np.quantile(lengths, QUANTILES, method="higher"))
    k = 1 << max(0, whole.bit_length() - 1)
    while k <= ABOVE_KEEP_WHOLE * whole:
        out.update(on_grid(n, block) for n in (k, 3 * k // 2) if n > whole)
        k *= 2
    if limits is not None:
        out.update(on_grid(n, block) for n in (limits.trained, limits.supported))
    return sorted(n for n in out if n <= MAX_ROW_TOKENS)


@dataclass(frozen=True)
class RowOption:
    """One weighed row length: the corpus in its rows, the plan there, and the epoch it adds up to."""

    seq_len: int
    rows: int
    useful_fraction: float  # non-padding tokens / row slots
    documents_split: int  # longer than the row: split, truncated or dropped per data.long_docs
    longest_piece: int
    fits: bool  # the plan fits the device and host budgets
    within_context: bool  # no piece passes the positions the model supports (or model.allow_long_context)
    keeps_whole: bool  # the row holds KEEP_WHOLE of the documents whole
    steps: int
    step_s: float
    hours: float
    precision: str
    policy: str
    fit: FitPlan = dataclasses.field(repr=False, compare=False)  # the plan at this length

    @property
    def eligible(self) -> bool:
        """Whether a run may take this length."""
        return self.fits and self.within_context

    @property
    def timed(self) -> bool:
        """Whether step_s and hours are time (a measured or assumed speed), not an unknown speed's ranking."""
        return self.fit.plan.chosen.time.source != UNKNOWN

    def to_json(self) -> dict:
        """The option as the plan's JSON writes it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fit"}


@dataclass(frozen=True)
class RowLengthChoice:
    """What data.seq_len=auto weighed and took."""

    chosen: RowOption
    options: tuple[RowOption, ...]
    describe: str  # the corpus the lengths came from
    why: str

    @property
    def seq_len(self) -> int:
        """The chosen row length."""
        return self.chosen.seq_len

    def to_json(self) -> dict:
        """The choice as the plan's JSON and the run's summary write it."""
        return {
            "seq_len": self.seq_len,
            "why": self.why,
            "corpus": self.describe,
            "options": [o.to_json() for o in self.options],
        }


CONTEXT_ROWS = (
    "planned at the model's supported context; plan.documents=N plan.doc_tokens=T or data.path choose from the "
    "documents"
)


def epoch_steps(fit: FitPlan, rows: int, epochs: float, data_ranks: int) -> int:
    """Optimizer steps `epochs` passes over `rows` packed rows take under this fit."""
    return math.ceil(rows * epochs / (fit.plan.chosen.micro_batch * fit.plan.chosen.grad_accum * max(1, data_ranks)))


def weigh_row_length(
    plan_at: PlanAt,
    seq_len: int,
    documents: Documents,
    attention: AttentionSpec,
    limits: ContextLimits,
    *,
    cp: int,
    data_ranks: int,
    long_context: bool,
) -> RowOption:
    """One candidate: rows of `seq_len` over the documents, packed and planned by `plan_at` (cp: parallel.cp,
    data_ranks: the ranks that split the rows, long_context: model.allow_long_context)."""
    lengths, pack = documents.lengths, documents.pack
    stats, pieces = pack(seq_len)
    pairs = packed_pairs(attention, pieces, seq_len, f"the mask of the packed rows of {seq_len:,} tokens")
    fit = plan_at(seq_len, pairs)
    steps = epoch_steps(fit, stats.rows, documents.epochs, data_ranks)
    return RowOption(
        seq_len=seq_len,
        rows=stats.rows,
        useful_fraction=stats.useful_token_fraction,
        documents_split=stats.documents_split + stats.documents_truncated + stats.documents_dropped,
        longest_piece=stats.longest_piece,
        fits=fit.plan.chosen.usage.fits,
        within_context=stats.longest_piece <= limits.supported or long_context,
        keeps_whole=seq_len >= keep_whole_length(lengths, CP_BLOCK_SIZE * cp),
        steps=steps,
        step_s=fit.plan.chosen.time.step_s,
        hours=steps * fit.plan.chosen.time.step_s / 3600,
        precision=fit.precision.name,
        policy=fit.plan.chosen.label,
        fit=fit,
    )


def fastest(options: Sequence[RowOption]) -> RowOption:
    """The shortest of the options within TIE_BAND of the least epoch time."""
    least = min(o.hours for o in options)
    return min((o for o in options if o.hours <= least * (1 + TIE_BAND)), key=lambda o: o.seq_len)


def choose_row_length(
    plan_at: PlanAt,
    documents: Documents,
    hardware: HardwareConfig,
    attention: AttentionSpec,
    limits: ContextLimits,
    *,
    cp: int = 1,
    long_context: bool = False,  # model.allow_long_context
) -> RowLengthChoice:
    """data.seq_len=auto: every candidate weighed, the fastest eligible one that keeps documents whole taken (else
    the longest eligible one: the fewest documents split); limits: the model's context_limits. UserError: none fits."""
    lengths, describe = documents.lengths, documents.describe
    if len(lengths) == 0:
        raise UserError("data.seq_len=auto chooses from the documents' lengths, and there are no documents.")
    block, dp = CP_BLOCK_SIZE * cp, hardware.world_size // cp  # dp: the ranks that split the rows

    def weigh(lengths_to_try: Sequence[int]) -> tuple[RowOption, ...]:
        return tuple(
            weigh_row_length(plan_at, n, documents, attention, limits, cp=cp, data_ranks=dp, long_context=long_context)
            for n in lengths_to_try
        )

    options = weigh(candidate_lengths(lengths, block, limits))
    whole = [o for o in options if o.eligible and o.keeps_whole]
    if whole:
        chosen = fastest(whole)
        why = (
            f"the least estimated epoch time (within {TIE_BAND:.0%}: the shortest) of the lengths that hold "
            f"{KEEP_WHOLE:.0%} of the documents whole"
        )
        return RowLengthChoice(chosen, options, describe, why)
    shorter = [block << k for k in range(MAX_ROW_TOKENS.bit_length()) if block << k < options[0].seq_len]
    options = weigh(shorter) + options  # the fallback may need rows shorter than any candidate
    eligible = [o for o in options if o.eligible]
    if not eligible:
        raise UserError(
            f"data.seq_len=auto: no row length from {options[0].seq_len:,} to {options[-1].seq_len:,} tokens "
            f"fits {hardware.name} within the model's context ({limits.describe()}). Set data.seq_len to a "
            "number and see what `python -m flexengine.plan` suggests."
        )
    chosen = max(eligible, key=lambda o: o.seq_len)
    why = (
        f"no length holding {KEEP_WHOLE:.0%} of the documents whole fits {hardware.name}'s memory with no piece past "
        f"the {limits.supported:,} positions the model supports: the longest that does (the fewest documents split)"
    )
    return RowLengthChoice(chosen, options, describe, why)


def format_row_length(choice: RowLengthChoice) -> str:
    """The lengths weighed, as the plan prints them."""
    lines = [
        f"rows: data.seq_len=auto -> {choice.seq_len:,} tokens ({choice.why}); {choice.describe}",
        (
            f"  {'seq_len':>9} {'useful':>7} {'split':>7} {'rows':>9} {'steps':>8} {'s/step':>7} {'hours':>7}  "
            f"{'precision':<16} policy"
        ),
    ]
    for o in choice.options:
        notes = [note for ok, note in ((o.fits, "does not fit"), (o.within_context, "past the context")) if not ok]
        if not o.keeps_whole:
            notes.append(f"splits {o.documents_split:,} documents")
        mark = "  <- chosen" if o is choice.chosen else ""
        time = f"{o.step_s:>7.2f} {o.hours:>7.2f}" if o.timed else f"{'n/a':>7} {'n/a':>7}"
        lines.append(
            f"  {o.seq_len:>9,} {o.useful_fraction:>7.1%} {o.documents_split:>7,} {o.rows:>9,} {o.steps:>8,} "
            f"{time}  {o.precision:<16} {o.policy[:28]}" + (f" ({', '.join(notes)})" if notes else "") + mark
        )
    if not all(o.timed for o in choice.options):
        lines.append(f"  {NO_SPEED}")
    return "\n".join(lines)


def mfu_for_hours(option: RowOption, hours: float, assumed_mfu: float) -> Optional[float]:
    """The MFU at which this option's epoch would take `hours`, its compute scaled by assumed / MFU and the rest
    of the step (the host optimizer, exposed transfers and reductions, recomputed pointwise ops) held; None when
    that rest alone takes longer."""
    fit = option.fit
    t = fit.plan.chosen.time
    compute_s = (t.step_s - t.optimizer_s - t.reduce_exposed_s) / (fit.plan.chosen.grad_accum * (1 + t.cost))
    flops_bound_s = fit.plan.chosen.grad_accum * compute_s * (1 + t.recompute_flops_fraction)
    fixed_s = t.step_s - flops_bound_s
    target_step_s = hours * 3600 / option.steps
    if target_step_s <= fixed_s:
        return None
    return assumed_mfu * flops_bound_s / (target_step_s - fixed_s)


def mfu_ladder(option: RowOption, targets: Sequence[float] = ()) -> str:
    """One line: the MFU each target epoch time would need (default: the whole hours below the planned one), from
    the MFU the plan assumed; none where the step time is not an assumed MFU (measured, or an unknown speed)."""
    source = option.fit.plan.chosen.time.source
    if source == UNKNOWN:
        return "  (no MFU ladder: this device's speed is unknown, so there are no hours to scale)"
    if source != ASSUMED:
        return f"  {option.hours:.2f} h at the {source} (no MFU ladder: no MFU is assumed)"
    assumed_mfu = option.fit.plan.assumptions.get("assumed_mfu")
    if not assumed_mfu:
        return "  (no MFU assumed: the step time is not FLOPs-bound here)"
    if not targets:
        targets = [h for h in range(math.floor(option.hours), max(0, math.floor(option.hours) - 4), -1) if h > 0]
    parts = []
    for hours in targets:
        mfu = mfu_for_hours(option, hours, assumed_mfu)
        parts.append(f"{hours:g} h needs {'more than the compute' if mfu is None else f'{mfu:.1%} MFU'}")
    return (
        f"  {option.hours:.2f} h at the assumed {assumed_mfu:.0%} MFU; "
        + ", ".join(parts)
        + " (compute scaled, the host optimizer and exposed transfers held)"
    )
