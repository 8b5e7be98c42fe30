"""The trainer's components, built once for a run and handed to the Trainer (torchtitan's pattern): the optimizer and
its schedule, the run's shared counters (TrainState), the metrics writer, the run clock (Progress), the stop
signals, the Checkpointer and the Evaluator. Each holds what it needs from construction, so the trainer calls
`checkpointer.save(step)` or `evaluator.evaluate()` and hands none of them itself. They are built from a
TrainerSetup, the config sections and resolved specs of one run (run.py makes it, with the held-out set and the data
plan a resume must match); `Trainer(setup, components)` is the one way to build a trainer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from flexengine.core.config import DataConfig, LoraConfig, LossConfig, OptimConfig, TrainConfig
from flexengine.core.distributed import DistInfo
from flexengine.core.parallel_spec import ParallelSpec
from flexengine.core.storage import CHECKPOINTS
from flexengine.data.loader import HeldOut, RowLoader
from flexengine.loop.checkpointer import Checkpointer
from flexengine.loop.evaluator import Evaluator
from flexengine.loop.forward import ForwardPath
from flexengine.loop.metrics import MetricsWriter
from flexengine.loop.optim import build_optimizer, build_scheduler, schedule_problem
from flexengine.loop.progress import PlannedStep, Progress
from flexengine.loop.signals import StopSignals
from flexengine.loop.state import TrainState
from flexengine.surgery.applied import applied

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerSetup:
    """One run as the loop reads it: the config sections its components take, the resolved specs, and the reports
    the run was built with (run.py's trainer_setup makes it from the job and the resolution)."""

    train: TrainConfig  # train.epochs already counted into max_steps
    optim: OptimConfig
    loss: LossConfig
    data: DataConfig  # a chat run's sample prompts go through the chat template
    parallel: ParallelSpec  # reduce_every as the planner chose it
    block_size: int  # attn.block_size: the evaluator's masks
    peak_tflops: Optional[float] = None  # hardware.peak_tflops, for MFU
    merge_lora: Optional[LoraConfig] = None  # the adapters a save merges into the weights (None: saved as they are)
    lora_base: Optional[Path] = None  # the base checkpoint a merged save copies its other files from
    planned: Optional[PlannedStep] = None  # the plan's step time, which the run clock compares its steps with
    hparams: dict[str, Any] = field(default_factory=dict)  # the run's choices, for TensorBoard's HPARAMS tab
    data_report: dict[str, Any] = field(default_factory=dict)  # summary.json's data section
    memory_report: dict[str, Any] = field(default_factory=dict)  # activation bytes (the first forward may measure)


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


def build_components(
    setup: TrainerSetup,
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
    train, optim = setup.train, setup.optim
    optimizer = build_optimizer(forward.model, optim, forward.device)
    scheduler: LambdaLR = build_scheduler(optimizer, optim, train.max_steps)
    if main and (problem := schedule_problem(optim, train.max_steps)):
        log.warning("optim: %s", problem)
    state = TrainState()
    metrics = MetricsWriter(out_dir / "tb" if main else None, out_dir / "metrics.jsonl" if main else None)
    compiled = applied(forward.model).compile_backend is not None  # train.compile, or a policy that needs it
    progress = Progress(
        train, state, peak_tflops=setup.peak_tflops, is_main=main, compiled_blocks=compiled, planned=setup.planned
    )
    signals = StopSignals(forward.device, lambda: state.step)  # SIGINT/SIGTERM: which, how many, agreed
    checkpointer = Checkpointer(
        out_dir / CHECKPOINTS,
        train=train,
        optim=optim,
        merge_lora=setup.merge_lora,
        lora_base=setup.lora_base,
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
        train,
        forward=forward,
        tokenizer=tokenizer,
        state=state,
        progress=progress,
        metrics=metrics,
        signals=signals,
        checkpointer=checkpointer,
        block_size=setup.block_size,
        is_main=main,
        data=setup.data,
    )
    return Components(forward, optimizer, scheduler, state, metrics, progress, signals, checkpointer, evaluator, dist)
