"""The trainer's components, built once for a run and handed to the Trainer (torchtitan's pattern): the optimizer and
its schedule, the run's shared counters (TrainState), the metrics writer, the run clock (Progress), the stop
signals, the Checkpointer and the Evaluator. Each holds what it needs from construction, so the trainer calls
`checkpointer.save(step)` or `evaluator.evaluate()` and hands none of them itself. run.py builds them (with the
held-out set and the data plan a resume must match); a Trainer built by hand gets the same set without those."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from flexengine.core.config import JobConfig
from flexengine.core.distributed import DistInfo
from flexengine.core.storage import CHECKPOINTS
from flexengine.data.loader import HeldOut, RowLoader
from flexengine.loop.checkpointer import Checkpointer
from flexengine.loop.evaluator import Evaluator
from flexengine.loop.forward import ForwardPath
from flexengine.loop.metrics import MetricsWriter
from flexengine.loop.optim import build_optimizer, build_scheduler, schedule_problem
from flexengine.loop.progress import Progress
from flexengine.loop.signals import StopSignals
from flexengine.loop.state import TrainState
from flexengine.surgery.applied import applied

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Components:
    """What the Trainer runs with besides its loop (see the module docstring)."""

    forward: ForwardPath
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    state: TrainState
    metrics: MetricsWriter
    progress: Progress
    signals: StopSignals
    checkpointer: Checkpointer
    evaluator: Evaluator
    dist: DistInfo  # the ranks they were built for

    def check_built_for(
        self,
        job: JobConfig,
        loader: RowLoader,
        tokenizer: Optional[PreTrainedTokenizerBase],
        out_dir: Path,
        dist: DistInfo,
    ) -> None:
        """Refuse a Trainer whose job, loader, tokenizer, output directory or ranks are not the ones these
        components were built around."""
        # the Checkpointer holds what they were built around: a Trainer running another job or loader would save
        # checkpoints that record another stream's position and step budget than the one it trains
        built = self.checkpointer
        given = {"job": (built.job, job), "loader": (built.loader, loader), "tokenizer": (built.tokenizer, tokenizer)}
        differ = [name for name, (theirs, ours) in given.items() if theirs is not ours]
        differ += ["out_dir"] if built.root.parent.resolve() != Path(out_dir).resolve() else []
        differ += ["dist"] if self.dist != dist else []
        if differ:
            raise ValueError(
                f"Trainer(components=...): got another {' and '.join(differ)} than the components were built "
                "around (build_components); pass the same objects to both"
            )


def build_components(
    job: JobConfig,
    forward: ForwardPath,
    loader: RowLoader,
    tokenizer: Optional[PreTrainedTokenizerBase],
    *,
    out_dir: Path,
    dist: DistInfo,
    held_out: Optional[HeldOut] = None,
    data_plan: Optional[dict[str, Any]] = None,
) -> Components:
    """One run's components around `forward`, sharing one TrainState. held_out: the evaluations' set (None: no
    evaluation); data_plan: the data stream's fingerprint a resume must match (None: not checked)."""
    main = dist.is_main
    optimizer = build_optimizer(forward.model, job.optim, forward.device)
    scheduler: LambdaLR = build_scheduler(optimizer, job.optim, job.train.max_steps)
    if schedule_problem(job.optim, job.train.max_steps) and main:
        log.warning("optim: %s", schedule_problem(job.optim, job.train.max_steps))
    state = TrainState()
    metrics = MetricsWriter(out_dir / "tb" if main else None, out_dir / "metrics.jsonl" if main else None)
    compiled = applied(forward.model).compile_backend is not None  # train.compile, or a policy that needs it
    progress = Progress(job.train, state, peak_tflops=job.hardware.peak_tflops, is_main=main, compiled_blocks=compiled)
    signals = StopSignals(forward.device, lambda: state.step)  # SIGINT/SIGTERM: which, how many, agreed
    checkpointer = Checkpointer(
        out_dir / CHECKPOINTS,
        job,
        forward=forward,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        state=state,
        progress=progress,
        metrics=metrics,
        data_plan=data_plan,
        is_main=main,
    )
    evaluator = Evaluator(
        held_out,
        job.train,
        forward=forward,
        tokenizer=tokenizer,
        state=state,
        progress=progress,
        metrics=metrics,
        signals=signals,
        checkpointer=checkpointer,
        block_size=job.attn.block_size,
        is_main=main,
        data=job.data,  # a chat run's sample prompts go through the chat template
    )
    return Components(forward, optimizer, scheduler, state, metrics, progress, signals, checkpointer, evaluator, dist)
