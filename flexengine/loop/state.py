"""`TrainState`: the run's counters, one object shared by the trainer (which counts each step into it) and the
components that read or restore it (Checkpointer, Evaluator, Progress, StopSignals)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Counters that travel with checkpoints."""

    step: int = 0
    tokens_seen: int = 0  # row slots processed by the whole job (each row once), padding included
    useful_tokens_seen: int = 0  # real document tokens processed by the whole job
    losses: list[float] = field(default_factory=list)  # per optimizer step
    skipped_nonfinite: int = 0
    block_density_sum: float = 0.0
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step", "loss", "ppl", "tokens"} per evaluation
    best_eval_loss: float = math.inf
    best_step: int = 0
    evals_since_best: int = 0  # for train.early_stop_patience
    model_flops: float = 0.0  # model FLOPs of the steps so far (MFU's numerator; flexengine.loop.flops)
    hardware_flops: float = 0.0  # FLOPs executed: padding, recompute, attention as the backend runs it

    def restore(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's counters, in place (the components and the signal handler hold this object)."""
        if "block_sparsity_sum" in saved:  # checkpoints written before the rename
            saved = {**saved, "block_density_sum": saved["block_sparsity_sum"]}
        known = {f.name for f in dataclasses.fields(TrainState)}
        loaded = TrainState(**{k: v for k, v in saved.items() if k in known})  # absent fields: their defaults
        for f in dataclasses.fields(TrainState):
            setattr(self, f.name, getattr(loaded, f.name))
