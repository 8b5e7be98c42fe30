"""What a run reports as it goes and at its end, and the clock it reports against.

`Progress` is the trainer's run clock: the whole run's time and its training time (each adding up over resumes),
the pauses inside the loop that are not training (evaluations, samples), where this launch's loop started; and
what is reported against it: the counters between two log lines, the step line with its ETA, the bar, and the
training numbers of summary.json (read from the run's shared TrainState). The functions below it give the
hyperparameters TensorBoard compares runs by.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from flexengine.core.config import TrainConfig
from flexengine.loop.metrics import MetricsWriter, allocator_stats, peak_memory_bytes, utilization
from flexengine.loop.state import TrainState
from flexengine.surgery.attention.spec import AttentionSpec

log = logging.getLogger(__name__)


@dataclass
class _Window:
    """Counters between two log lines."""

    start: float  # time.perf_counter() when it began
    tokens: int = 0
    useful: int = 0
    model_flops: float = 0.0
    hardware_flops: float = 0.0


@dataclass(frozen=True)
class PlannedStep:
    """What the plan promised for one optimizer step (run.py hands it over: the loop reads no plan)."""

    step_s: float  # the planner's step time
    source: str  # where its seconds come from: measured device speed, assumed MFU x datasheet peak, unknown
    assumed_mfu: Optional[float] = None  # the MFU the estimate assumed (None: its speed is measured, or unknown)
    terms: dict[str, float] = field(default_factory=dict)  # its seconds by term (the doctor names the likely one)
    known: bool = True  # False: the device's speed is unknown, so step_s only ranked policies: no time to compare

    @property
    def seconds(self) -> Optional[float]:
        """The planned step in seconds where that is time (a known speed), else None."""
        return self.step_s if self.known and self.step_s else None


def warmup_steps(compiled: bool) -> int:
    """Steps of a launch left out of its measured step time: the first (allocator, caches, the token cache's pages),
    and with compiled blocks the second too (a recompile of the backward's graph can land there). Blocks compile
    under train.compile and under a memory policy that needs them compiled (surgery/compile.needs_compiled_blocks)."""
    return 2 if compiled else 1


class Progress:
    """The run clock and the reports made against it (see the module docstring)."""

    def __init__(
        self,
        train: TrainConfig,
        state: TrainState,
        *,
        peak_tflops: Optional[float],
        is_main: bool = True,
        compiled_blocks: Optional[bool] = None,
        planned: Optional[PlannedStep] = None,
    ):
        self.train, self.state, self.peak_tflops, self.is_main = train, state, peak_tflops, is_main
        # whether the decoder blocks run compiled (they compile in their first steps); None: as train.compile says
        self.compiled_blocks = train.compile if compiled_blocks is None else compiled_blocks
        self.wall_s = 0.0  # the whole run so far: training, evaluations, samples, saves (a resume adds up)
        self.train_s = 0.0  # training steps only: what tokens/s and MFU divide by
        self.loop_start_step = 0  # the step this launch's loop started from
        self.last_pause_s = 0.0  # the latest evaluation's or sampling's time
        self._run_start: Optional[float] = None  # when train() began (its time joins wall_s)
        self._loop_start = time.perf_counter()
        self._in_loop = False  # inside the loop: its running time is training time not yet added to train_s
        self._paused_s = 0.0  # evaluation/sampling time inside this loop (not training)
        self._window = _Window(time.perf_counter())
        self.planned = planned  # the plan's step (None: no plan to compare with)
        self.step_times: list[float] = []  # this launch's optimizer steps, each from its start to its metrics
        self._step_start = time.perf_counter()

    # -- the clock ------------------------------------------------------------------------------------------------
    def start_run(self) -> None:
        """train() begins: from here its time joins wall_s."""
        self._run_start = time.perf_counter()

    def start_loop(self, step: int) -> None:
        """The loop begins at `step` (after a resume, the checkpoint's)."""
        self._loop_start, self.loop_start_step, self._in_loop = time.perf_counter(), step, True
        self._window = _Window(time.perf_counter())

    def end_loop(self) -> None:
        """The loop is done: its training time joins train_s."""
        self.train_s, self._in_loop = self.elapsed_train(), False
        self._paused_s = 0.0

    def start_step(self) -> None:
        """An optimizer step begins (its time ends at `count`)."""
        self._step_start = time.perf_counter()

    def measured_step_s(self) -> tuple[Optional[float], int]:
        """(the median of this launch's steps after the warm-up ones, the steps left out); all steps' median when
        no more ran; None before any."""
        skip = warmup_steps(self.compiled_blocks)
        kept = self.step_times[skip:] or self.step_times
        if not kept:
            return None, 0
        return statistics.median(kept), len(self.step_times) - len(kept)

    def pause(self, seconds: float) -> None:
        """An evaluation or sampling inside the loop took `seconds`: not training time."""
        self._paused_s += seconds
        self.last_pause_s = seconds

    def exclude_last_pause(self) -> None:
        """Leave the latest pause out of the log window's rates too (evaluations are not training)."""
        self._window.start += self.last_pause_s

    def elapsed_train(self) -> float:
        """train_s including the part of the loop still running (a checkpoint saved inside the loop records it)."""
        running = time.perf_counter() - self._loop_start - self._paused_s if self._in_loop else 0.0
        return self.train_s + running

    def elapsed_wall(self) -> float:
        """wall_s including the part of train() still running."""
        running = time.perf_counter() - self._run_start if self._run_start is not None else 0.0
        return self.wall_s + running

    def steps_run(self, step: int) -> int:
        """Steps this launch's loop has run by `step` (0: it resumed at train.max_steps)."""
        return step - self.loop_start_step

    def mean_step_s(self, step: int) -> float:
        """This launch's mean training step time so far (its pauses left out)."""
        running = time.perf_counter() - self._loop_start - self._paused_s
        return running / max(1, self.steps_run(step))

    def restore(self, wall_s: float, train_s: float) -> None:
        """A resumed run's times so far (this launch adds to them)."""
        self.wall_s, self.train_s = wall_s, train_s

    # -- what is reported as the run goes ---------------------------------------------------------------------------
    def count(self, m: dict) -> None:
        """Add one step's metrics to the log window."""
        self.step_times.append(time.perf_counter() - self._step_start)
        w = self._window
        w.tokens += m["tokens"]
        w.useful += m["useful_tokens"]
        w.model_flops += m["model_flops"]
        w.hardware_flops += m["hardware_flops"]

    def log_step(self, metrics: MetricsWriter, m: dict, step: int, *, eta_s: float, device: torch.device) -> None:
        """One logged step: the window's rates with the step's metrics (TensorBoard, metrics.jsonl) and, on rank 0,
        the step line with the ETA; the next window starts."""
        w = self._window
        dt = time.perf_counter() - w.start
        useful_per_s = w.useful / dt
        metrics.scalars(
            {
                "loss": m["loss"],
                "lr": m["lr"],
                "grad_norm": m["grad_norm"],
                "tokens_per_s": w.tokens / dt,
                "useful_tokens_per_s": useful_per_s,
                "mfu": utilization(w.model_flops / dt, 1.0, self.peak_tflops),
                "hfu": utilization(w.hardware_flops / dt, 1.0, self.peak_tflops),
                "peak_memory_bytes": peak_memory_bytes(device),
                **allocator_stats(device),  # None off CUDA: left out of TensorBoard and metrics.jsonl
                "useful_token_fraction": m["useful_tokens"] / m["tokens"],
                "block_density": m["block_density"],
                **self._step_time_scalars(),
            },
            step,
        )
        if self.is_main:
            log.info("%s", format_step_line(step, self.train.max_steps, m, useful_per_s, eta_s))
        self._window = _Window(time.perf_counter())

    def _step_time_scalars(self) -> dict[str, Optional[float]]:
        """The latest step's time, the plan's and the ratio of the measured median so far to it (TensorBoard)."""
        return {
            "step_s": self.step_times[-1] if self.step_times else None,
            "planned_step_s": self.planned.seconds if self.planned is not None else None,
            "step_time_ratio": self.step_time_report()["ratio"],
        }

    def step_time_report(self) -> dict[str, Any]:
        """summary.json's step_time: planned against measured step seconds, their ratio, and the measured MFU
        against the one the plan assumed."""
        measured, skipped = self.measured_step_s()
        planned = self.planned
        seconds = planned.seconds if planned is not None else None
        ratio = measured / seconds if measured and seconds else None  # none against an unknown speed's figure
        return {
            "planned_s": planned.step_s if planned is not None else None,
            "planned_source": planned.source if planned is not None else None,
            "measured_s": measured,  # the median of this launch's steps after the warm-up ones
            "measured_steps": len(self.step_times) - skipped,
            "excluded_first_steps": skipped,
            "ratio": ratio,  # measured / planned: 1.0 is a plan held to
            "mfu": utilization(self.state.model_flops, self.train_s, self.peak_tflops),
            "assumed_mfu": planned.assumed_mfu if planned is not None else None,
            "planned_terms_s": dict(planned.terms) if planned is not None else {},
        }

    def bar(self, step: int):
        """tqdm only on a terminal: in a job log its carriage returns are noise (the log lines carry it all)."""
        if not self.train.progress or not self.is_main or not sys.stderr.isatty():
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.train.max_steps, initial=step, desc="train", unit="step")

    # -- what is reported at the end --------------------------------------------------------------------------------
    def summary(self, attn: Optional[AttentionSpec], device: torch.device) -> dict[str, Any]:
        """summary.json's training numbers (the trainer adds the evaluations and how the run ended): counters,
        rates over training time, MFU/HFU, losses, memory peaks and the clock. attn: None under HF's own attention."""
        s = self.state
        wall = self.train_s  # rates are of training time (evaluations and saves are not steps)
        peak = self.peak_tflops

        def per_s(amount: float) -> Optional[float]:  # no training time (no step ran, ever): no rate, not amount/1e-9
            return amount / wall if wall > 0 else None

        patched = attn is not None and attn.backend.patched
        return {
            "steps": s.step,
            "steps_run": self.steps_run(s.step),  # by this launch (0: resumed at train.max_steps)
            "tokens_seen": s.tokens_seen,
            "useful_tokens_seen": s.useful_tokens_seen,
            "useful_token_fraction": s.useful_tokens_seen / max(1, s.tokens_seen),
            "tokens_per_s": per_s(s.tokens_seen),
            "useful_tokens_per_s": per_s(s.useful_tokens_seen),
            # MFU: model FLOPs (6N-style + attended pairs, useful tokens); HFU: FLOPs executed (with recompute)
            "mfu": utilization(s.model_flops, wall, peak),
            "hfu": utilization(s.hardware_flops, wall, peak),
            "model_flops": s.model_flops,
            "hardware_flops": s.hardware_flops,
            "initial_loss": s.losses[0] if s.losses else None,
            "final_loss": s.losses[-1] if s.losses else None,
            "losses": list(s.losses),
            "skipped_nonfinite_steps": s.skipped_nonfinite,
            "block_density": s.block_density_sum / max(1, s.step) if patched else None,
            "attention": attn.as_dict() if attn is not None else None,
            "peak_memory_bytes": peak_memory_bytes(device),
            **allocator_stats(device),  # the run's allocator peaks and counters (null off CUDA)
            "wall_s": self.elapsed_wall(),  # the whole run, evaluations included
            "train_s": self.train_s,  # training steps only (tokens/s, MFU)
            "step_time": self.step_time_report(),
        }


def _or_nan(value: Optional[float]) -> float:
    return float("nan") if value is None else value


def hparam_metrics(summary: dict) -> dict:
    """The numbers TensorBoard's HPARAMS tab compares runs by (the held-out losses when there are evaluations)."""
    metrics = {
        "final_loss": _or_nan(summary["final_loss"]),
        "useful_tokens_per_s": _or_nan(summary["useful_tokens_per_s"]),
    }
    if summary["eval"]:
        metrics.update(eval_loss=summary["eval"]["loss"], best_eval_loss=summary["eval"]["best_loss"])
    return metrics


def tqdm_logging():
    """Log records printed above the progress bar instead of through it."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_step_line(step: int, max_steps: int, m: dict, useful_per_s: float, eta_s: float) -> str:
    """The plain-text progress line: readable in a job log where a progress bar is not."""
    return (
        f"step {step}/{max_steps} | loss {m['loss']:.4f} | lr {m['lr']:.3g} | grad norm {m['grad_norm']:.3g} | "
        f"{useful_per_s:,.0f} useful tok/s | ETA {_duration(eta_s)}"
    )
