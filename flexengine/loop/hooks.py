"""The callbacks a Trainer calls during a step: how tools (the doctor, a profiler, a test) observe training
without patching it."""

from __future__ import annotations

from typing import Any

PHASES = ("data", "mask", "forward", "backward", "optimizer")  # the timed parts of one optimizer step


class StepHooks:
    """Override what you need; the trainer calls every registered hook (`Trainer.add_hooks`).

    With `timed = True` the trainer synchronises the device around each phase of a step and reports its wall
    time through `on_phase`: exact phase times, at the cost of the overlap they remove (diagnosis, not training).
    """

    timed: bool = False

    def on_step_start(self, trainer: Any, step: int) -> None:
        """Before a step loads its first micro-batch; `step` = the trainer's completed steps + 1 (a driver that
        calls `train_step` itself, like the doctor, does not advance that count)."""

    def on_phase(self, trainer: Any, name: str, seconds: float) -> None:
        """One phase (see PHASES) of the current step took `seconds` (called per micro-batch where it repeats)."""

    def on_step_end(self, trainer: Any, step: int, metrics: dict) -> None:
        """After the optimizer step, with the step's metrics (loss, grad_norm, tokens, ...)."""
