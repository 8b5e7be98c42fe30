"""What a run reports as it goes and at its end: the step line and its metrics, the ETA, the progress bar, the
summary and the hyperparameters TensorBoard compares runs by."""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

from flexengine.core.storage import CHECKPOINTS
from flexengine.loop.checkpoint.save import step_dir
from flexengine.loop.eval_loop import saves_best
from flexengine.loop.metrics import allocator_stats, peak_memory_bytes, utilization

log = logging.getLogger(__name__)


def new_window() -> dict:
    """Counters between two log lines."""
    return {"t": time.perf_counter(), "tokens": 0, "useful": 0, "model_flops": 0.0, "hardware_flops": 0.0}


def log_step(trainer, m: dict, tokens_per_s: float, useful_per_s: float, flops_per_s: tuple) -> None:
    """One logged step: its metrics (TensorBoard, metrics.jsonl) and, on rank 0, the step line with the ETA."""
    peak = trainer.job.hardware.peak_tflops
    trainer.metrics.scalars(
        {
            "loss": m["loss"],
            "lr": m["lr"],
            "grad_norm": m["grad_norm"],
            "tokens_per_s": tokens_per_s,
            "useful_tokens_per_s": useful_per_s,
            "mfu": utilization(flops_per_s[0], 1.0, peak),
            "hfu": utilization(flops_per_s[1], 1.0, peak),
            "peak_memory_bytes": peak_memory_bytes(trainer.device),
            **allocator_stats(trainer.device),  # None off CUDA: left out of TensorBoard and metrics.jsonl
            "useful_token_fraction": m["useful_tokens"] / m["tokens"],
            "block_density": m["block_density"],
        },
        trainer.state.step,
    )
    if trainer.dist.is_main:
        log.info(
            "%s", format_step_line(trainer.state.step, trainer.job.train.max_steps, m, useful_per_s, eta_s(trainer))
        )


def eta_s(trainer) -> float:
    """Seconds left: the remaining steps at this process's mean training step time, plus the evaluations still
    due at the mean time of one so far (before the first: a forward-only guess, a third of a micro-batch step)."""
    cfg = trainer.job.train
    done = trainer.state.step - trainer._loop_start_step
    step_s = (time.perf_counter() - trainer._loop_start - trainer._paused_s) / max(1, done)
    eta = step_s * (cfg.max_steps - trainer.state.step)
    if trainer.eval_data is None:
        return eta
    every = cfg.eval_every
    # the step line is logged before its step's evaluation, so an evaluation at this very step is still due
    in_loop = cfg.max_steps // every - (max(trainer.state.step, 1) - 1) // every if every else 0
    final = not every or cfg.max_steps % every > 0  # the end of the run is always evaluated
    due = in_loop + final
    if trainer._eval_seconds:
        one = sum(trainer._eval_seconds) / len(trainer._eval_seconds)
    else:
        one = trainer.eval_data.num_batches * step_s / cfg.grad_accum / 3
    return eta + due * one


def progress_bar(trainer):
    """tqdm only on a terminal: in a job log its carriage returns are noise (the log lines carry it all)."""
    if not trainer.job.train.progress or not trainer.dist.is_main or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=trainer.job.train.max_steps, initial=trainer.state.step, desc="train", unit="step")


def summary(trainer) -> dict:
    """The numbers summary.json reports."""
    s = trainer.state
    wall = trainer.train_s  # rates are of training time (evaluations and saves are not steps)

    def per_s(amount: float) -> Optional[float]:  # no training time (no step ran, ever): no rate, not amount/1e-9
        return amount / wall if wall > 0 else None

    return {
        "steps": s.step,
        "steps_run": s.step - trainer._loop_start_step,  # by this launch (0: resumed at train.max_steps)
        "tokens_seen": s.tokens_seen,
        "useful_tokens_seen": s.useful_tokens_seen,
        "useful_token_fraction": s.useful_tokens_seen / max(1, s.tokens_seen),
        "tokens_per_s": per_s(s.tokens_seen),
        "useful_tokens_per_s": per_s(s.useful_tokens_seen),
        # MFU: model FLOPs (6N-style + attended pairs, useful tokens); HFU: FLOPs executed (with recompute)
        "mfu": utilization(s.model_flops, wall, trainer.job.hardware.peak_tflops),
        "hfu": utilization(s.hardware_flops, wall, trainer.job.hardware.peak_tflops),
        "model_flops": s.model_flops,
        "hardware_flops": s.hardware_flops,
        "initial_loss": s.losses[0] if s.losses else None,
        "final_loss": s.losses[-1] if s.losses else None,
        "losses": list(s.losses),
        "skipped_nonfinite_steps": s.skipped_nonfinite,
        "block_density": s.block_density_sum / max(1, s.step) if trainer._patched_attention else None,
        "attention": trainer.attn.as_dict() if trainer.attn is not None else None,
        "peak_memory_bytes": peak_memory_bytes(trainer.device),
        **allocator_stats(trainer.device),  # the run's allocator peaks and counters (null off CUDA)
        "wall_s": trainer._elapsed_wall(),  # the whole run, evaluations included
        "train_s": trainer.train_s,  # training steps only (tokens/s, MFU)
        "eval_s": sum(trainer._eval_seconds),  # evaluations of this process
        "stopped_by_signal": trainer.signals.signal,
        "status": "interrupted" if trainer._interrupted else "ok",
        "stopped_early": trainer.stopped_early,
        "eval": eval_summary(trainer),
        "exit_code": trainer.exit_code,
    }


def eval_summary(trainer) -> Optional[dict]:
    s = trainer.state
    if not s.evals:
        return None
    best = step_dir(trainer.out_dir / CHECKPOINTS, s.best_step)
    return {
        "loss": s.evals[-1]["loss"],
        "ppl": s.evals[-1]["ppl"],
        "best_loss": s.best_eval_loss,
        "best_step": s.best_step,
        "best_checkpoint": str(best) if saves_best(trainer) else None,
        "history": list(s.evals),
    }


def hparams(trainer) -> dict:
    j = trainer.job
    return {
        "model": j.model.name,
        "attn": j.attn.mode,
        "backend": trainer.attn.backend.value if trainer.attn is not None else "hf",
        "memory": j.memory.policy,
        "precision": j.precision.mode,
        "optimizer": j.optim.name,
        "seq_len": j.data.seq_len,
        "packing": j.data.packing,
        "micro_batch": j.train.micro_batch,
        "grad_accum": j.train.grad_accum,
        "lr": j.optim.lr,
        "schedule": j.optim.schedule,
        "warmup_steps": j.optim.warmup_for(j.train.max_steps),
        "weight_decay": j.optim.weight_decay,
        "max_steps": j.train.max_steps,
        "lora_r": j.model.lora.r,  # 0 = full fine-tuning
        "eval_fraction": j.data.eval_fraction,
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
