"""Stop signals: SIGINT/SIGTERM finish the step (or cut an evaluation/sampling short), the ranks agree on the stop."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from types import FrameType
from typing import Any, Callable, Iterator, Optional, Union

import torch

log = logging.getLogger(__name__)


class StopSignals:
    """The signal state of one training process: which signal came, how many, and whether the ranks agreed."""

    def __init__(self, device: torch.device, step: Callable[[], int]):
        self.device = device
        self.step = step  # the last finished step (the Trainer's state is replaced on resume: read it when asked)
        self.signal: Optional[int] = None  # set by this process's signal handler
        self.count = 0  # SIGINT/SIGTERM received while handle() is active
        self.handling = False  # handle() is active (it nests)
        self.agreed = False  # some rank had a signal at the start of the last step (all ranks agree)
        self.pause: Optional[str] = None  # "evaluation" / "sampling" while one runs (a signal cuts it short)
        self.saving_step: Optional[int] = None  # the step whose checkpoint is being written (a signal waits for it)
        self.save_completes_run = False  # that save is the end of a finished run: a signal then changes nothing

    @contextlib.contextmanager
    def pausing(self, activity: str) -> Iterator[None]:
        """Mark an evaluation or sampling pause (the signal handler then says it stops at the next batch/token)."""
        self.pause = activity
        try:
            yield
        finally:
            self.pause = None

    @contextlib.contextmanager
    def saving(self, step: int, completes_run: bool) -> Iterator[None]:
        """Mark a checkpoint save of `step` (a signal then says it waits for that save). completes_run: the save
        ends a run that did all its steps, so a signal during it leaves a complete run (exit status 0)."""
        self.saving_step, self.save_completes_run = step, completes_run
        try:
            yield
        finally:
            self.saving_step, self.save_completes_run = None, False

    def first_signal_message(self, signum: int) -> str:
        """What the first signal does now, in words: which step, pause or save it waits for, and the exit status
        that follows (the Trainer's exit_code gives the same number)."""
        status = 128 + signum
        if self.saving_step is not None and self.save_completes_run:
            return (
                f"signal {signum}: finishing the final save (step {self.saving_step}); the run has done all its "
                "steps, so it ends complete with status 0"
            )
        if self.saving_step is not None:
            doing = f"finishing the checkpoint save of step {self.saving_step}"
            if torch.distributed.is_initialized():  # the ranks vote in the next step: they all stop after it
                after = f"the ranks stop together after step {self.saving_step + 1}"
                return f"signal {signum}: {doing}; {after}, then saving and exiting with status {status}"
            return f"signal {signum}: {doing}, then exiting with status {status}"
        if self.pause:
            unit = "batch" if self.pause == "evaluation" else "token"
            doing = f"stopping the {self.pause} at its next {unit}"
        else:
            doing = f"finishing step {self.step() + 1}"
        return f"signal {signum}: {doing}, then saving and exiting with status {status}"

    def requested(self) -> bool:
        """Asked between eval batches and sampled tokens: whether a stop signal came. Under torchrun the ranks agree
        through one small all-reduce (each forward there is a collective: all ranks must leave after the same one);
        its cost is nothing beside an eval batch's or a whole row's forward."""
        mine = self.signal is not None
        if not torch.distributed.is_initialized():
            return mine
        vote = torch.tensor([float(mine)], device=self.device)
        torch.distributed.all_reduce(vote)
        self.agreed = self.agreed or bool(vote.item() > 0)
        return self.agreed

    def should_stop(self) -> bool:
        """Whether the loop stops before its next step (under torchrun: the ranks' agreed vote of the last step)."""
        return self.agreed if torch.distributed.is_initialized() else self.signal is not None

    @contextlib.contextmanager
    def handle(self) -> Iterator[None]:
        """SIGINT/SIGTERM finish the current step, save and stop; a second signal only says the save is still
        running; a third gives up the save: the previous handler runs (Ctrl-C raises KeyboardInterrupt, SIGTERM
        ends the process). run_training holds this over the summary write too. The old handlers come back at
        the end."""
        if self.handling:
            yield
            return
        # what signal.signal returns: a handler, SIG_DFL/SIG_IGN, or None (one not installed from Python)
        previous: dict[int, Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]] = {}

        def request_stop(signum: int, frame: Optional[FrameType]) -> None:
            self.count += 1
            if self.signal is None:
                self.signal = signum
                log.warning("%s", self.first_signal_message(signum))
            elif self.count == 2:
                log.warning(
                    "signal %d again: still finishing and saving (step %d); exiting when the checkpoint "
                    "and summary are written. A third signal aborts and loses this save (the previous "
                    "checkpoint stays intact)",
                    signum,
                    self.step(),
                )
            else:
                log.warning(
                    "signal %d a third time: aborting; the checkpoint being written is lost, the previous "
                    "one is intact",
                    signum,
                )
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                handler = previous.get(signum, signal.SIG_DFL)
                if callable(handler):
                    handler(signum, frame)  # Python's SIGINT handler: KeyboardInterrupt here
                elif handler != signal.SIG_IGN:
                    os.kill(os.getpid(), signum)  # the default action: end the process by this signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread (e.g. under some launchers)
                previous[sig] = signal.signal(sig, request_stop)
        self.handling = True
        try:
            yield
        finally:
            self.handling = False
            for signum, handler in previous.items():
                signal.signal(signum, handler)
