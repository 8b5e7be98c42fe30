"""The loop's evaluations and samples: held-out loss, the best checkpoint and early stopping, greedy continuations;
a stop signal cuts either short."""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from flexengine.core.storage import CHECKPOINTS
from flexengine.loop.checkpoint.save import mark_best, step_dir
from flexengine.loop.checkpointer import prune
from flexengine.loop.evaluate import EvalProgress, eval_budget_warning, evaluate_loss, greedy_continue

log = logging.getLogger(__name__)


def evaluate(trainer) -> Optional[dict]:
    """Eval loss/perplexity on the held-out set; marks (and saves) a new best, counts early-stop patience.
    None when a stop signal cut it short (within one eval batch)."""
    start = time.perf_counter()
    trainer.model.eval()
    with trainer.signals.pausing("evaluation"):
        result = evaluate_loss(
            trainer.train_module,
            trainer.eval_data.batches(),
            trainer.device,
            trainer._prepare,
            trainer.compute_context,
            stop=trainer.signals.requested,
            on_batch=EvalProgress(trainer.state.step, trainer.eval_data.num_batches, enabled=trainer.dist.is_main),
        )
    trainer.model.train()
    if result is not None:
        trainer._eval_seconds.append(time.perf_counter() - start)
        check_eval_budget(trainer, trainer._eval_seconds[-1])
    if result is None:  # a stop signal: no eval record (a partial set is no loss to compare), on to the save
        cut_short(trainer, "evaluation", start)
        return None
    s, cfg = trainer.state, trainer.job.train
    record = {"step": s.step, **result}
    s.evals.append(record)
    trainer.metrics.scalars({"loss": result["loss"], "ppl": result["ppl"]}, s.step, kind="eval")
    improved = result["loss"] < s.best_eval_loss
    if improved:
        s.best_eval_loss, s.best_step, s.evals_since_best = result["loss"], s.step, 0
    else:
        s.evals_since_best += 1
    log.info(
        "eval step %d: loss %.4f | ppl %.2f | %d tokens | best %.4f (step %d)",
        s.step,
        result["loss"],
        result["ppl"],
        result["tokens"],
        s.best_eval_loss,
        s.best_step,
    )
    if improved and saves_best(trainer):
        path = trainer.save() if trainer._saved_step != s.step else step_dir(trainer.out_dir / CHECKPOINTS, s.step)
        if trainer.dist.is_main:
            mark_best(path.parent, path)
        prune(trainer)  # the previous best may be past keep_last now
    if cfg.early_stop_patience and s.evals_since_best >= cfg.early_stop_patience:
        trainer.stopped_early = True
        log.warning(
            "early stop at step %d: no better eval loss in %d evaluations (best %.4f at step %d)",
            s.step,
            s.evals_since_best,
            s.best_eval_loss,
            s.best_step,
        )
    trainer._last_eval_s = time.perf_counter() - start
    trainer._paused_s += trainer._last_eval_s
    return record


def check_eval_budget(trainer, eval_s: float) -> None:
    """After the first in-loop evaluation: warn when one costs more than ~10 % of the training between two, and
    say which train.eval_batches would fit."""
    cfg = trainer.job.train
    done = trainer.state.step - trainer._loop_start_step
    if len(trainer._eval_seconds) != 1 or not cfg.eval_every or not done or trainer.state.step >= cfg.max_steps:
        return
    step_s = (time.perf_counter() - trainer._loop_start - trainer._paused_s - eval_s) / done
    warning = eval_budget_warning(eval_s, trainer.eval_data.num_batches, cfg.eval_every, step_s, cfg.eval_batches)
    if warning and trainer.dist.is_main:
        log.warning("eval: %s", warning)


def saves_best(trainer) -> bool:
    """train.save_best, in a run that writes checkpoints at all (save_final or save_every)."""
    cfg = trainer.job.train
    return cfg.save_best and bool(cfg.save_final or cfg.save_every)


def sample(trainer) -> Optional[list[str]]:
    """Greedy continuations of train.sample_prompts, written to TensorBoard text (samples/<i>); None when a
    stop signal cut it short (within one generated token)."""
    start = time.perf_counter()
    cfg = trainer.job.train

    def logits_of(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # through the root module (FSDP2/DDP hooks run there): every rank calls it with the same row
        batch = {"input_ids": input_ids, "position_ids": position_ids}
        if trainer.context_parallel is not None:  # the row split over the cp ranks, the logits put together
            return trainer.context_parallel.logits(trainer.train_module, trainer.model, batch)
        return trainer.train_module(batch, logits=True)

    trainer.model.eval()
    with trainer.compute_context(), trainer.signals.pausing("sampling"):
        # rows in whole blocks per cp rank (the context-parallel split needs cp x block_size)
        texts = greedy_continue(
            logits_of,
            trainer.tokenizer,
            cfg.sample_prompts,
            cfg.sample_tokens,
            trainer.device,
            pad_to=trainer.job.attn.block_size * trainer._cp,
            stop=trainer.signals.requested,
        )
    trainer.model.train()
    if texts is None:
        cut_short(trainer, "sampling", start)
        return None
    for i, (prompt, text) in enumerate(zip(cfg.sample_prompts, texts)):
        trainer.metrics.text(f"samples/{i}", f"**{prompt}**{text}", trainer.state.step)
        trainer.metrics.record({"type": "sample", "step": trainer.state.step, "prompt": prompt, "text": text})
    trainer._last_sample_step = trainer.state.step
    trainer._paused_s += time.perf_counter() - start
    return texts


def cut_short(trainer, activity: str, start: float) -> None:
    """An evaluation or sampling a signal stopped: the run ends as interrupted (saved, 128 + signal), so a
    requeue with train.resume=auto does what is left."""
    trainer._interrupted = True
    trainer._last_eval_s = time.perf_counter() - start
    trainer._paused_s += trainer._last_eval_s
    log.warning("signal: %s at step %d stopped; saving and exiting", activity, trainer.state.step)
