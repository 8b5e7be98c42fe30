"""The Trainer's save and resume: its state beside the weights, the finite check, pruning, an exact resume."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from flexengine.core.errors import UserError
from flexengine.core.storage import CHECKPOINTS
from flexengine.loop.checkpoint.load import load_checkpoint_state, load_checkpoint_weights, resolve_resume
from flexengine.loop.checkpoint.save import prune_checkpoints, save_checkpoint
from flexengine.loop.nonfinite import nonfinite_message, nonfinite_names, optimizer_tensors
from flexengine.loop.optim import apply_knots, exported_weights, planned_update, resumed_knots

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters that travel with checkpoints."""

    step: int = 0
    tokens_seen: int = 0  # row slots processed by the whole job (each row once), padding included
    useful_tokens_seen: int = 0  # real document tokens processed by the whole job
    losses: list = field(default_factory=list)  # per optimizer step
    skipped_nonfinite: int = 0
    block_density_sum: float = 0.0
    evals: list = field(default_factory=list)  # {"step", "loss", "ppl", "tokens"} per evaluation
    best_eval_loss: float = math.inf
    best_step: int = 0
    evals_since_best: int = 0  # for train.early_stop_patience
    model_flops: float = 0.0  # model FLOPs of the steps so far (MFU's numerator; flexengine.loop.flops)
    hardware_flops: float = 0.0  # FLOPs executed: padding, recompute, attention as the backend runs it


def _rng_state() -> dict:
    # numpy's state as tensors and primitives: the checkpoint loads with weights_only=True and no numpy globals
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {
        "kind": kind,
        "key": torch.from_numpy(key.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainer_state(trainer) -> dict:
    """Everything besides the weights that an exact resume needs."""
    return {
        "train": asdict(trainer.state),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "data": trainer.loader.state_dict(),
        "rng": _rng_state(),
        "wall_s": trainer._elapsed_wall(),
        "train_s": trainer.elapsed_train(),  # this launch's loop so far included
        "max_steps": trainer.job.train.max_steps,  # the schedule's length: a resume with another one is told
        "data_plan": dict(trainer.data_plan),
    }


def save(trainer) -> Path:
    """Checkpoint to out_dir/checkpoints/step_<N> (every rank calls this; rank 0 writes the weights)."""
    lora = trainer.job.model.lora
    merge = lora if lora.r > 0 and trainer.job.train.merge_lora_on_save else None
    weights = exported_weights(trainer.optimizer, trainer.model)
    check_finite(trainer, weights)
    path = save_checkpoint(
        trainer.out_dir / CHECKPOINTS,
        trainer.state.step,
        trainer.model,
        trainer.tokenizer,
        trainer_state(trainer),
        merge_lora=merge,
        weights=weights,
        finite_checked=True,
        base_dir=Path(trainer.job.model.path) if merge is not None and trainer.job.model.loads_weights else None,
    )
    trainer._saved_step = trainer.state.step
    prune(trainer)
    return path


def check_finite(trainer, weights: Optional[dict]) -> None:
    """Refuse to save NaN/Inf weights or optimizer states (UserError naming them and the likely optim.* cause;
    every rank raises, as the save is collective)."""
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    named = [*trainer.model.named_parameters(), *optimizer_tensors(trainer.optimizer, names), *(weights or {}).items()]
    bad = nonfinite_names(named)
    count = len(bad)
    if torch.distributed.is_initialized():
        total = torch.tensor([float(count)], device=trainer.device)
        torch.distributed.all_reduce(total)
        count = int(total.item())
    if count:
        raise UserError(nonfinite_message(trainer.state.step, bad, trainer.job.optim))


def prune(trainer) -> None:
    """train.keep_last: the newest checkpoints stay, and so do the best and the resumed-from one."""
    if trainer.dist.is_main:
        prune_checkpoints(trainer.out_dir / CHECKPOINTS, trainer.job.train.keep_last, protect=(trainer.resumed_from,))


def resume(trainer, spec: str) -> Optional[Path]:
    """train.resume: auto (newest verifying checkpoint under out_dir/checkpoints, if any) or a step_<N> dir."""
    path = resolve_resume(spec, trainer.out_dir / CHECKPOINTS, bool(trainer.job.train.output_dir))
    if path is None:  # a requeued run that never saved starts again: its earlier records would repeat
        trainer.metrics.truncate_after(0)
        return None
    state = load_checkpoint_state(path)
    new_data = check_data_plan(trainer, state.get("data_plan", {}), path)  # before the weights: a cheap refusal
    load_checkpoint_weights(path, trainer.model)
    trainer.optimizer.load_state_dict(state["optimizer"])
    resume_schedule(trainer, state)
    if not new_data:
        try:
            trainer.loader.load_state_dict(state["data"])
        except ValueError as e:
            raise UserError(f"train.resume={spec}: {e}") from None
    _set_rng_state(state["rng"])
    known = {f.name for f in dataclasses.fields(TrainState)}
    saved = state["train"]
    if "block_sparsity_sum" in saved:  # checkpoints written before the rename
        saved = {**saved, "block_density_sum": saved["block_sparsity_sum"]}
    trainer.state = TrainState(**{k: v for k, v in saved.items() if k in known})
    trainer.wall_s = state.get("wall_s", 0.0)
    trainer.train_s = state.get("train_s", trainer.wall_s)  # older checkpoints: wall_s was training time only
    trainer.resumed_from = path
    trainer._saved_step = trainer.state.step
    trainer.metrics.truncate_after(trainer.state.step)  # the killed run's records past its checkpoint
    log.info("resumed from %s at step %d", path, trainer.state.step)
    return path


def resume_schedule(trainer, state: dict) -> None:
    """Load the saved schedule and fit it to this run's train.max_steps (train.resume_schedule: continue or
    rederive, see optim.resumed_knots)."""
    scheduler, train = trainer.scheduler, trainer.job.train
    scheduler.load_state_dict(state["scheduler"])
    saved_lr = float(trainer.optimizer.param_groups[0]["lr"])
    saved_max = state.get("max_steps") or train.max_steps
    # checkpoints from before the knots were saved ran the plain schedule over their max_steps
    knots = state["scheduler"].get("knots") or [[0, 0], [saved_max, saved_max]]
    done = scheduler.last_epoch
    apply_knots(scheduler, trainer.job.optim, resumed_knots(knots, done, train.max_steps, train.resume_schedule))
    warn_schedule_change(trainer, state, saved_lr, finished=planned_update(done, knots) >= knots[-1][1])


def warn_schedule_change(trainer, state: dict, saved_lr: float, finished: bool = False) -> None:
    """A resume whose schedule differs from the saved run's (train.max_steps, optim.*): say what the lr does."""
    lr = float(trainer.optimizer.param_groups[0]["lr"])
    before, train = state.get("max_steps"), trainer.job.train
    if math.isclose(lr, saved_lr, rel_tol=1e-6, abs_tol=1e-12) and before in (None, train.max_steps):
        return
    step = state["train"]["step"] + 1
    if before in (None, train.max_steps):  # optim.* changed: the schedule itself is another one
        what = (
            f"the lr schedule changed (optim.*): the lr of step {step} is {lr:.3g} (the saved run's was {saved_lr:.3g})"
        )
    elif train.resume_schedule == "rederive":
        what = (
            f"train.max_steps {before} -> {train.max_steps}, train.resume_schedule=rederive: the schedule is planned "
            f"over {train.max_steps} steps from step 0, so the lr of step {step} is {lr:.3g} (the saved run's was "
            f"{saved_lr:.3g}); train.resume_schedule=continue goes on from the saved lr instead"
        )
    elif finished:
        what = (
            f"train.max_steps {before} -> {train.max_steps}: the saved run had finished its schedule, so "
            f"(train.resume_schedule=continue) its {train.max_steps - step + 1} new steps keep the lr of its last "
            f"step, {lr:.3g}; train.resume_schedule=rederive plans a schedule over {train.max_steps} steps instead"
        )
    else:
        what = (
            f"train.max_steps {before} -> {train.max_steps}, train.resume_schedule=continue: the lr goes on from "
            f"the saved run's {saved_lr:.3g}, with the rest of its warmup and decay stretched over the "
            f"{train.max_steps - step + 1} steps left; train.resume_schedule=rederive plans the schedule over "
            f"{train.max_steps} steps from step 0 instead (the lr jumps)"
        )
    log.warning("resume: %s.", what)


def check_data_plan(trainer, saved: dict, path: Path) -> bool:
    """Refuse a resume onto a different data stream unless train.resume_new_data; True = start the new data
    from its first row."""
    changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in trainer.data_plan.items() if saved.get(k) != v]
    if not changed:
        return False
    if not trainer.job.train.resume_new_data:
        raise UserError(
            f"train.resume: {path} was trained on another data stream; changed: "
            + "; ".join(changed)
            + ". Resuming would not continue that run's data order. Resume with the original settings, or "
            "set train.resume_new_data=true to keep the weights, optimizer and step count and read the new "
            "data from its first row."
        )
    log.warning(
        "resume: the data stream changed (%s); train.resume_new_data=true: reading the new data from its first row",
        "; ".join(changed),
    )
    return True
