"""The trainer's checkpoint component: what its state is beside the weights, when a save happens (every step at
most once, the best one kept), the finite check, pruning, and an exact resume.

The format on disk is loop/checkpoint/'s; `Checkpointer` decides what goes in and restores it. It owns which step
is on disk, which checkpoint the run resumed from, and the data plan a resume must match; it holds, from its
construction (loop/components.py), what it saves and restores: the model, optimizer, schedule, data position, the
run's shared counters (TrainState), the clock and the metrics writer.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR

from flexengine.core.config import LoraConfig, OptimConfig, TrainConfig
from flexengine.core.errors import UserError
from flexengine.data.loader import RowLoader
from flexengine.loop.checkpoint.load import load_checkpoint_state, load_checkpoint_weights, resolve_resume
from flexengine.loop.checkpoint.save import mark_best, prune_checkpoints, save_checkpoint, step_dir
from flexengine.loop.forward import ForwardPath
from flexengine.loop.metrics import MetricsWriter
from flexengine.loop.nonfinite import nonfinite_message, nonfinite_names, optimizer_tensors
from flexengine.loop.optim import apply_knots, exported_weights, planned_update, resumed_knots
from flexengine.loop.progress import Progress
from flexengine.loop.state import TrainState

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def _rng_state() -> dict[str, Any]:
    # numpy's state as tensors and primitives: the checkpoint loads with weights_only=True and no numpy globals
    legacy = np.random.get_state()  # legacy=True (the default): the tuple, not the dict form
    assert isinstance(legacy, tuple)
    kind, key, pos, has_gauss, gauss = legacy
    numpy_state = {
        "kind": kind,
        "key": torch.from_numpy(key.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves the run to <root>/step_<N> and resumes it (see the module docstring). Every rank calls `save` and
    `resume` (the save is collective); rank 0 writes the weights, prunes and points best/ at the best step."""

    def __init__(
        self,
        root: Path,
        *,
        train: TrainConfig,
        optim: OptimConfig,
        merge_lora: Optional[LoraConfig] = None,
        lora_base: Optional[Path] = None,
        forward: ForwardPath,
        tokenizer: Optional[PreTrainedTokenizerBase],
        optimizer: torch.optim.Optimizer,
        scheduler: LambdaLR,
        loader: RowLoader,
        state: TrainState,
        progress: Progress,
        metrics: MetricsWriter,
        data_plan: Optional[dict[str, Any]] = None,
        is_main: bool = True,
    ) -> None:
        self.root, self.train, self.optim, self.forward, self.tokenizer = root, train, optim, forward, tokenizer
        # merge_lora: the adapters merged into a save's weights; lora_base: the checkpoint its other files come from
        self.merge_lora, self.lora_base = merge_lora, lora_base
        self.optimizer, self.scheduler, self.loader = optimizer, scheduler, loader
        self.state, self.progress, self.metrics, self.is_main = state, progress, metrics, is_main
        self.data_plan = dict(data_plan or {})  # what the data stream depends on; a resume must match it
        self.saved_step = -1  # the step whose checkpoint is on disk (no double save of one step)
        self.resumed_from: Optional[Path] = None  # never deleted by train.keep_last

    def state_dict(self) -> dict[str, Any]:
        """Everything besides the weights that an exact resume needs."""
        return {
            "train": asdict(self.state),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "rng": _rng_state(),
            "wall_s": self.progress.elapsed_wall(),
            "train_s": self.progress.elapsed_train(),  # this launch's loop so far included
            "max_steps": self.train.max_steps,  # the schedule's length: a resume with another one is told
            "data_plan": dict(self.data_plan),
        }

    def save(self, step: int) -> Path:
        """Checkpoint step `step`, the shared TrainState's current one (every rank calls this; rank 0 writes the
        weights)."""
        if step != self.state.step:
            raise ValueError(f"Checkpointer.save({step}): the run's state is at step {self.state.step}")
        model = self.forward.model
        weights = exported_weights(self.optimizer, model)
        check_finite(self.forward, self.optimizer, weights, step=step, optim=self.optim)
        path = save_checkpoint(
            self.root,
            step,
            model,
            self.tokenizer,
            self.state_dict(),
            merge_lora=self.merge_lora,
            weights=weights,
            finite_checked=True,
            base_dir=self.lora_base,
        )
        self.saved_step = step
        self.prune()
        return path

    def keep_best(self) -> None:
        """A new best eval loss at the current step: with train.save_best, save it (once) and point best/ at it."""
        if not saves_best(self.train):
            return
        step = self.state.step
        path = self.save(step) if self.saved_step != step else step_dir(self.root, step)
        if self.is_main:
            mark_best(self.root, path)
        self.prune()  # the previous best may be past keep_last now

    def best_checkpoint(self) -> Optional[Path]:
        """Where the best step's checkpoint is (None when train.save_best keeps none)."""
        return step_dir(self.root, self.state.best_step) if saves_best(self.train) else None

    def prune(self) -> None:
        """train.keep_last: the newest checkpoints stay, and so do the best and the resumed-from one."""
        if self.is_main:
            prune_checkpoints(self.root, self.train.keep_last, protect=(self.resumed_from,))

    def resume(self, spec: Optional[str] = None) -> Optional[Path]:
        """train.resume (or `spec`): auto (newest verifying checkpoint under the root, if any) or a step_<N> dir;
        the checkpoint's path, or None when there is none to resume (or no resume asked for)."""
        train = self.train
        spec = train.resume if spec is None else spec
        if not spec:
            return None
        path = resolve_resume(spec, self.root, bool(train.output_dir))
        if path is None:  # a requeued run that never saved starts again: its earlier records would repeat
            self.metrics.truncate_after(0)
            return None
        state = load_checkpoint_state(path)
        new_data = check_data_plan(self.data_plan, state["data_plan"], path, train.resume_new_data)  # cheap
        load_checkpoint_weights(path, self.forward.model)
        self.optimizer.load_state_dict(state["optimizer"])
        resume_schedule(self.scheduler, self.optim, train, state)
        if not new_data:
            try:
                self.loader.load_state_dict(state["data"])
            except ValueError as e:
                raise UserError(f"train.resume={spec}: {e}") from None
        _set_rng_state(state["rng"])
        self.state.restore(state["train"])
        self.progress.restore(state["wall_s"], state["train_s"])
        self.resumed_from, self.saved_step = path, self.state.step
        self.metrics.truncate_after(self.state.step)  # the killed run's records past its checkpoint
        log.info("resumed from %s at step %d", path, self.state.step)
        return path


def saves_best(train: TrainConfig) -> bool:
    """train.save_best, in a run that writes checkpoints at all (save_final or save_every)."""
    return train.save_best and bool(train.save_final or train.save_every)


def check_finite(
    forward: ForwardPath, optimizer: torch.optim.Optimizer, weights: Optional[dict], *, step: int, optim: OptimConfig
) -> None:
    """Refuse to save NaN/Inf weights or optimizer states (UserError naming them and the likely optim.* cause;
    every rank raises, as the save is collective)."""
    model = forward.model
    names = {id(p): name for name, p in model.named_parameters()}
    named = [*model.named_parameters(), *optimizer_tensors(optimizer, names), *(weights or {}).items()]
    bad = nonfinite_names(named)
    count = len(bad)
    if torch.distributed.is_initialized():
        total = torch.tensor([float(count)], device=forward.device)
        torch.distributed.all_reduce(total)
        count = int(total.item())
    if count:
        raise UserError(nonfinite_message(step, bad, optim))


def resume_schedule(scheduler: LambdaLR, optim: OptimConfig, train: TrainConfig, state: dict[str, Any]) -> None:
    """Load the saved schedule and fit it to this run's train.max_steps (train.resume_schedule: continue or
    rederive, see optim.resumed_knots)."""
    scheduler.load_state_dict(state["scheduler"])
    saved_lr = float(scheduler.optimizer.param_groups[0]["lr"])  # what the saved schedule had for the next step
    knots = state["scheduler"]["knots"]  # the saved run's schedule (apply_knots keeps them on the scheduler)
    done = scheduler.last_epoch
    apply_knots(scheduler, optim, knots)  # the saved run's schedule, for the lr its last step ran at
    # float(): torch types base_lrs as float | Tensor (a tensor lr, as torchao keeps it, stays one here)
    last_lr = float(scheduler.base_lrs[0] * scheduler.lr_lambdas[0](done - 1)) if done > 0 else saved_lr
    apply_knots(scheduler, optim, resumed_knots(knots, done, train.max_steps, train.resume_schedule))
    lr = float(scheduler.optimizer.param_groups[0]["lr"])
    warn_schedule_change(train, state, lr, saved_lr, last_lr, finished=planned_update(done, knots) >= knots[-1][1])


def warn_schedule_change(
    train: TrainConfig, state: dict[str, Any], lr: float, saved_lr: float, last_lr: float, finished: bool
) -> None:
    """A resume whose schedule differs from the saved run's (train.max_steps, optim.*): say what the lr does, in
    the lrs the loop logs -- the last trained step's (last_lr) and the first resumed step's (lr). saved_lr: the lr
    the saved schedule had for that first resumed step."""
    before = state["max_steps"]
    if math.isclose(lr, saved_lr, rel_tol=1e-6, abs_tol=1e-12) and before == train.max_steps:
        return
    step = state["train"]["step"] + 1
    left = train.max_steps - step + 1
    if before == train.max_steps:  # optim.* changed: the schedule itself is another one
        what = (
            f"the lr schedule changed (optim.*): step {step}, the first resumed, runs at lr {lr:.3g} (the saved "
            f"run's schedule had {saved_lr:.3g} for it)"
        )
    elif train.resume_schedule == "rederive":
        what = (
            f"train.max_steps {before} -> {train.max_steps}, train.resume_schedule=rederive: the schedule is planned "
            f"over {train.max_steps} steps from step 0, so step {step}, the first resumed, runs at lr {lr:.3g}, where "
            f"step {step - 1}, the last trained, ran at {last_lr:.3g}; train.resume_schedule=continue goes on from "
            "there instead"
        )
    elif finished:
        what = (
            f"train.max_steps {before} -> {train.max_steps}: the saved run had finished its schedule, so "
            f"(train.resume_schedule=continue) its {left} new steps keep the lr its last step, {step - 1}, ran at: "
            f"{lr:.3g}; train.resume_schedule=rederive plans a schedule over {train.max_steps} steps instead"
        )
    else:
        what = (
            f"train.max_steps {before} -> {train.max_steps}, train.resume_schedule=continue: step {step - 1}, the "
            f"last trained, ran at lr {last_lr:.3g}; step {step}, the first resumed, runs at {lr:.3g}, the rest of "
            f"the saved run's warmup and decay stretched over the {left} steps left; train.resume_schedule=rederive "
            f"plans the schedule over {train.max_steps} steps from step 0 instead (the lr jumps)"
        )
    log.warning("resume: %s.", what)


def check_data_plan(data_plan: dict, saved: dict, path: Path, resume_new_data: bool) -> bool:
    """Refuse a resume onto a different data stream unless train.resume_new_data; True = start the new data
    from its first row."""
    changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in data_plan.items() if saved.get(k) != v]
    if not changed:
        return False
    if not resume_new_data:
        rows = saved.get("data.seq_len")  # data.seq_len=auto may choose another length on another run
        same_rows = (
            f" (e.g. data.seq_len={rows}, the checkpoint's row length)" if rows != data_plan.get("data.seq_len") else ""
        )
        raise UserError(
            f"train.resume: {path} was trained on another data stream; changed: "
            + "; ".join(changed)
            + f". Resuming would not continue that run's data order. Resume with the original settings{same_rows}, or "
            "set train.resume_new_data=true to keep the weights, optimizer and step count and read the new "
            "data from its first row."
        )
    log.warning(
        "resume: the data stream changed (%s); train.resume_new_data=true: reading the new data from its first row",
        "; ".join(changed),
    )
    return True
