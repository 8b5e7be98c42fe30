"""The training loop: accumulate, clip, step, schedule, log, checkpoint, resume."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from torch import nn

from flexengine.core.config import JobConfig
from flexengine.core.errors import UserError
from flexengine.core.storage import CHECKPOINTS
from flexengine.data.loader import HeldOut, RowLoader
from flexengine.data.targets import count_valid_targets
from flexengine.loop.checkpoint import (
    load_checkpoint_state,
    load_checkpoint_weights,
    mark_best,
    prune_checkpoints,
    resolve_resume,
    save_checkpoint,
    step_dir,
)
from flexengine.loop.evaluate import EvalProgress, eval_budget_warning, evaluate_loss, greedy_continue
from flexengine.loop.flops import TrainFlops, attended_pairs
from flexengine.loop.hooks import StepHooks
from flexengine.loop.metrics import MetricsWriter, peak_memory_bytes, utilization
from flexengine.loop.nonfinite import nonfinite_message, nonfinite_names, optimizer_tensors, suspect_settings
from flexengine.loop.optim import (
    build_optimizer,
    build_scheduler,
    clip_gradients,
    exported_weights,
    last_backward,
    schedule_problem,
)
from flexengine.loop.profiling import start_profiler
from flexengine.surgery.applied import attention_spec
from flexengine.surgery.attention import MASK_KWARG, mask_kwargs
from flexengine.surgery.context_parallel import ContextParallel
from flexengine.surgery.parallel import DistInfo, LossForward, grad_norm_value, gradient_sync
from flexengine.surgery.precision import PrecisionSpec, autocast_context, spec_for_params

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


def rows_counted_once(summed: torch.Tensor, cp: int) -> torch.Tensor:
    """Counts over the job's rows from their all-reduced sum over ranks: the cp ranks of a context-parallel group
    read the same rows, so the sum holds each row cp times (exact: integer counts in float64)."""
    return summed / cp


def _new_window() -> dict:
    """Counters between two log lines."""
    return {"t": time.perf_counter(), "tokens": 0, "useful": 0, "model_flops": 0.0, "hardware_flops": 0.0}


class Trainer:
    """Runs `train.max_steps` optimizer steps of a patched model over a RowLoader."""

    def __init__(
        self,
        job: JobConfig,
        model: nn.Module,
        tokenizer,
        loader: RowLoader,
        *,
        out_dir: Path,
        device: torch.device,
        dist: Optional[DistInfo] = None,
        train_module: Optional[nn.Module] = None,
        eval_data: Optional[HeldOut] = None,
        precision: Optional[PrecisionSpec] = None,
        context_parallel: Optional[ContextParallel] = None,
    ):
        self.job, self.model, self.tokenizer, self.loader = job, model, tokenizer, loader
        self.context_parallel = context_parallel  # parallel.cp > 1: each batch is split over the cp ranks
        self.out_dir, self.device, self.dist = out_dir, device, dist if dist is not None else DistInfo()
        # resolved by planning/fit.py (run.py); a Trainer built by hand gets its job's mode or its weights' dtype
        self.precision = (
            precision
            if precision is not None
            else spec_for_params(job.precision.mode, job.optim.name, next(model.parameters()).dtype)
        )
        # what forward/backward goes through: the FSDP/DDP root under torchrun, else a plain loss module
        self.train_module = train_module if train_module is not None else LossForward(model, job.loss.chunk_size)
        self.optimizer = build_optimizer(model, job.optim, device)
        self.scheduler = build_scheduler(self.optimizer, job.optim, job.train.max_steps)
        if schedule_problem(job.optim, job.train.max_steps) and self.dist.is_main:
            log.warning("optim: %s", schedule_problem(job.optim, job.train.max_steps))
        self.eval_data = eval_data  # the held-out rows; None = no held-out set
        self.state = TrainState()
        self.metrics = MetricsWriter(
            out_dir / "tb" if self.dist.is_main else None, out_dir / "metrics.jsonl" if self.dist.is_main else None
        )
        self.attn = attention_spec(model)  # None: HF's own attention, untouched
        self.flops = TrainFlops(model, job.loss.chunk_size)  # recompute: what the memory surgery recorded
        self._stop_signal: Optional[int] = None  # set by this process's signal handler
        self._signals = 0  # SIGINT/SIGTERM received while stop_on_signals() is active
        self._handling_signals = False  # stop_on_signals() is active (it nests)
        self._interrupted = False  # a signal stopped the loop, or cut an evaluation/sampling short (not: a signal
        # that came after the last step, during the final save)
        self._saved_step = -1  # the step whose checkpoint is on disk (no double save of one step)
        self.data_plan: dict = {}  # what the data stream depends on (run.build_trainer); checked on resume
        self._stop_agreed = False  # some rank had a signal at the start of the last step (all ranks agree)
        self.stopped_early = False  # train.early_stop_patience ran out
        self.resumed_from: Optional[Path] = None  # never deleted by train.keep_last
        self._last_sample_step = -1
        self._pause: Optional[str] = None  # "evaluation" / "sampling" while one runs (a signal cuts it short)
        self._paused_s = self._last_eval_s = 0.0  # evaluation/sampling time inside the loop (not training)
        self._loop_start, self._loop_start_step = time.perf_counter(), 0
        self.wall_s = 0.0  # the whole run so far: training, evaluations, samples, saves (a resume adds up)
        self.train_s = 0.0  # training steps only: what tokens/s and MFU divide by
        self._train_start: Optional[float] = None  # when train() began (its time joins wall_s)
        self._eval_seconds: list = []  # each evaluation's forward passes in this process (ETA, eval budget)
        self.hooks: list[StepHooks] = []  # observers of each step (the doctor); none in a plain run

    def add_hooks(self, hooks: StepHooks) -> None:
        """Register step callbacks (flexengine.loop.hooks.StepHooks)."""
        self.hooks.append(hooks)

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time one phase for the hooks that ask for it (device synchronised on both sides), else nothing."""
        timed = [h for h in self.hooks if h.timed]
        if not timed:
            yield
            return
        self.sync_device()
        t0 = time.perf_counter()
        yield
        self.sync_device()
        for h in timed:
            h.on_phase(self, name, time.perf_counter() - t0)

    def sync_device(self) -> None:
        """Wait for queued device work (timers then measure it; a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one optimizer step -------------------------------------------------------------------------------
    def _prepare(self, batch: dict) -> tuple[dict, dict]:
        """(the batch this rank computes, its mask kwargs): the attention mask is built once, here, so every layer
        shares it (and we can log its density); under context parallelism the rows are split over the cp ranks."""
        if self.context_parallel is not None:
            return self.context_parallel.shard(self.model, batch)
        return batch, mask_kwargs(self.model, batch["document_ids"])

    @property
    def _cp(self) -> int:
        return self.context_parallel.degree if self.context_parallel is not None else 1

    def _share(self, count: int) -> float:
        """This rank's share of a count over its rows, for its FLOPs (all of it, unless context parallelism splits
        the rows)."""
        return count if self._cp == 1 else count / self._cp

    @property
    def _patched_attention(self) -> bool:
        return self.attn is not None and self.attn.backend.patched

    def train_step(self) -> dict:
        """Forward/backward over grad_accum micro-batches, then clip and step. Returns step metrics."""
        for h in self.hooks:
            h.on_step_start(self, self.state.step + 1)
        with self._phase("data"):
            micro_batches = [self.loader.next_batch() for _ in range(self.job.train.grad_accum)]
        # The loss is sum(token CE) / valid tokens of the whole window: each backward() adds its share.
        # One all-reduce carries the window's valid-token count and the ranks' stop votes (a signal may reach
        # the ranks a step apart; all of them must stop after the same step, or the collectives would hang).
        # The same all-reduce sums the rows' tokens and useful tokens: the metrics count the whole job's rows.
        # (Host batches: these counts need no device sync.)
        counts = torch.tensor(
            [
                float(sum(count_valid_targets(b["labels"]) for b in micro_batches)),
                sum(b["input_ids"].numel() for b in micro_batches),
                sum(int(b["useful_tokens"]) for b in micro_batches),
                float(self._stop_signal is not None),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        rows = rows_counted_once(counts[:3], self._cp)  # valid targets, tokens, useful tokens of the job's rows
        n_valid = rows[0].clamp(min=1).float()
        loss_sum = torch.zeros((), device=self.device)
        density, model_flops, hardware_flops = [], 0.0, 0.0
        for i, host_batch in enumerate(micro_batches):
            # tensors only (pinned by the loader on CUDA, so non_blocking really is); host facts stay here
            batch = {
                k: v.to(self.device, non_blocking=True) for k, v in host_batch.items() if isinstance(v, torch.Tensor)
            }
            with self._phase("mask"):
                batch, mask_kwargs = self._prepare(batch)
            model_flops_mb, hardware_flops_mb = self._flops(host_batch, mask_kwargs)
            model_flops, hardware_flops = model_flops + model_flops_mb, hardware_flops + hardware_flops_mb
            # ranks reduce gradients once per window, in the last micro-batch's backward (DDP no_sync / FSDP2),
            # or in every backward (parallel.reduce_every=micro_batch: no unsharded gradients held between them)
            last = i == len(micro_batches) - 1
            with gradient_sync(self.train_module, enabled=last or self.job.parallel.reduce_every == "micro_batch"):
                with self._phase("forward"), self._autocast():
                    micro_loss = self.train_module(batch, **mask_kwargs)
                # the window's gradients are final in this backward: a host optimizer starts its downloads in it
                with self._phase("backward"), last_backward(self.optimizer, enabled=last):
                    (micro_loss / n_valid).backward()
            loss_sum += micro_loss.detach()
            if mask_kwargs:
                density.append(mask_kwargs[MASK_KWARG].block_density)
        loss = loss_sum / n_valid
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
        grad_norm = grad_norm_value(
            clip_gradients(
                self.optimizer,
                self.model.parameters(),
                self.job.optim.grad_clip if self.job.optim.grad_clip > 0 else float("inf"),
            )
        )
        block_density = torch.stack(density).float().mean() if density else torch.full((), float("nan"))
        # the one host sync per step: loss, grad norm, density, flex's executed FLOPs and the job's token counts
        # come back together (float64: token counts stay exact integers)
        loss_value, norm_value, density_value, stop_votes, hardware_flops, tokens, useful = torch.stack(
            [
                loss.double(),
                grad_norm.double().to(loss.device),
                block_density.double().to(loss.device),
                counts[3],
                torch.as_tensor(hardware_flops, dtype=torch.float64, device=loss.device),
                rows[1],
                rows[2],
            ]
        ).tolist()
        self._stop_agreed = stop_votes > 0
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        # this update's lr (read before the scheduler moves on); float(): torchao keeps it as a tensor, and the
        # metrics, the step line and metrics.jsonl need a number
        lr = float(self.optimizer.param_groups[0]["lr"])
        if finite:
            with self._phase("optimizer"):
                self.optimizer.step()
            self.scheduler.step()  # counts updates: a skipped step leaves the schedule where it was
        elif self.job.train.skip_nonfinite:
            self.state.skipped_nonfinite += 1
            log.warning("step %d: non-finite loss/grad (%s), step skipped", self.state.step + 1, loss_value)
        else:
            raise UserError(
                f"step {self.state.step + 1}: loss is {loss_value} (grad norm {norm_value}); training stopped "
                f"before the update. Likely cause: {suspect_settings(self.job.optim)}. Or set "
                "train.skip_nonfinite=true to skip (and count) such steps."
            )
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {  # tokens: the whole job's rows, each once (tokens/s is the job's throughput, MFU per device)
            "loss": loss_value,
            "grad_norm": norm_value,
            "tokens": int(tokens),
            "useful_tokens": int(useful),
            "lr": lr,
            "block_density": density_value if density else None,
            "model_flops": model_flops,
            "hardware_flops": hardware_flops,
        }
        for h in self.hooks:
            h.on_step_end(self, self.state.step + 1, metrics)
        return metrics

    def _flops(self, host_batch: dict, mask_kwargs: dict) -> tuple:
        """(model, hardware) FLOPs of one micro-batch; hardware is a device tensor under flex (no host sync)."""
        B, S = host_batch["input_ids"].shape
        predicting = len(host_batch["predicting_index"])
        windows = self.attn.layer_windows if self.attn is not None else (None,) * len(self.flops.blocks)
        pairs = {w: attended_pairs(host_batch["document_lengths"], w) for w in set(windows)}
        model = self.flops.model_flops(host_batch["useful_tokens"], predicting, [pairs[w] for w in windows])
        # HF's own attention has no masks of ours: its causal kernel computes the causal square of each row
        # (under context parallelism: this rank's mask, its share of the tokens)
        executed = mask_kwargs[MASK_KWARG].executed_pairs if mask_kwargs else B * S * (S + 1) // 2
        return self._share(model), self.flops.hardware_flops(self._share(B * S), self._share(predicting), executed)

    def _autocast(self):
        fsdp_casts = (
            self.dist.world_size > 1
            and self.job.parallel.strategy == "fsdp"
            and self.device.type == "cuda"
            and self.job.parallel.mixed_precision
        )  # MixedPrecisionPolicy computes in bf16 already
        return autocast_context(self.precision, self.device, sharded=fsdp_casts)

    # -- the loop -----------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to train.max_steps (or a stop signal, or early stopping); returns the run summary."""
        cfg = self.job.train
        self._train_start = time.perf_counter()
        with self.stop_on_signals():  # through the final save: a signal must not cut it short
            self._loop()
            stopped = self._interrupted = self._should_stop()
            if stopped:
                log.warning(
                    "stopped by signal %s after step %d; saving",
                    self._stop_signal or "(on another rank)",
                    self.state.step,
                )
            elif self.eval_data is not None and not any(e["step"] == self.state.step for e in self.state.evals):
                self.evaluate()  # the end of the run is always evaluated
            if self.job.train.sample_prompts and not self._interrupted and self._last_sample_step != self.state.step:
                self.sample()
            # a signal before step 1 leaves nothing trained to save (a resume starts fresh, the same thing); one that
            # cut the final evaluation or sampling short (_interrupted) saves too: the requeue resumes from it
            if (cfg.save_final or self._interrupted) and self._saved_step != self.state.step and self.state.step > 0:
                self.save()
            summary = self.summary()
            self.metrics.hparams(self._hparams(), self._hparam_metrics(summary))
            self.metrics.close()
        return summary

    def _loop(self) -> None:
        cfg = self.job.train
        progress = self._progress_bar()
        self.model.train()
        profiler = (
            start_profiler(self.out_dir, cfg.max_steps - self.state.step, cfg.profile_steps, self.device)
            if cfg.profile
            else None
        )
        self._loop_start, self._loop_start_step = time.perf_counter(), self.state.step
        window = _new_window()
        redirect = _tqdm_logging() if progress is not None else contextlib.nullcontext()
        with redirect:
            while self.state.step < cfg.max_steps and not self._should_stop() and not self.stopped_early:
                m = self.train_step()
                if profiler is not None:
                    profiler.step()
                self._count(m)
                window["tokens"] += m["tokens"]
                window["useful"] += m["useful_tokens"]
                window["model_flops"] += m["model_flops"]
                window["hardware_flops"] += m["hardware_flops"]
                step = self.state.step
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    dt = time.perf_counter() - window["t"]
                    self._log(
                        m,
                        window["tokens"] / dt,
                        window["useful"] / dt,
                        (window["model_flops"] / dt, window["hardware_flops"] / dt),
                    )
                    window = _new_window()
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{m['loss']:.3f}")
                if cfg.save_every and step % cfg.save_every == 0:
                    self.save()
                if self.eval_data is not None and cfg.eval_every and step % cfg.eval_every == 0:
                    self.evaluate()
                    window["t"] += self._last_eval_s  # evaluation is not training time
                if cfg.sample_prompts and self._sample_due(step) and not self._interrupted:
                    self.sample()
        self.train_s += time.perf_counter() - self._loop_start - self._paused_s
        self._paused_s = 0.0
        if profiler is not None:
            profiler.stop()
        if progress is not None:
            progress.close()

    def _count(self, m: dict) -> None:
        s = self.state
        s.step += 1
        s.losses.append(m["loss"])
        s.tokens_seen += m["tokens"]
        s.useful_tokens_seen += m["useful_tokens"]
        s.block_density_sum += m["block_density"] or 0.0
        s.model_flops += m["model_flops"]
        s.hardware_flops += m["hardware_flops"]

    def _sample_due(self, step: int) -> bool:
        every = self.job.train.sample_every
        if every:
            return step % every == 0
        return bool(self.state.evals) and self.state.evals[-1]["step"] == step  # with every evaluation

    def _log(self, m: dict, tokens_per_s: float, useful_per_s: float, flops_per_s: tuple) -> None:
        peak = self.job.hardware.peak_tflops
        self.metrics.scalars(
            {
                "loss": m["loss"],
                "lr": m["lr"],
                "grad_norm": m["grad_norm"],
                "tokens_per_s": tokens_per_s,
                "useful_tokens_per_s": useful_per_s,
                "mfu": utilization(flops_per_s[0], 1.0, peak),
                "hfu": utilization(flops_per_s[1], 1.0, peak),
                "peak_memory_bytes": peak_memory_bytes(self.device),
                "useful_token_fraction": m["useful_tokens"] / m["tokens"],
                "block_density": m["block_density"],
            },
            self.state.step,
        )
        if self.dist.is_main:
            log.info("%s", format_step_line(self.state.step, self.job.train.max_steps, m, useful_per_s, self._eta_s()))

    def _eta_s(self) -> float:
        """Seconds left: the remaining steps at this process's mean training step time, plus the evaluations still
        due at the mean time of one so far (before the first: a forward-only guess, a third of a micro-batch step)."""
        cfg = self.job.train
        done = self.state.step - self._loop_start_step
        step_s = (time.perf_counter() - self._loop_start - self._paused_s) / max(1, done)
        eta = step_s * (cfg.max_steps - self.state.step)
        if self.eval_data is None:
            return eta
        every = cfg.eval_every
        # the step line is logged before its step's evaluation, so an evaluation at this very step is still due
        in_loop = cfg.max_steps // every - (max(self.state.step, 1) - 1) // every if every else 0
        final = not every or cfg.max_steps % every > 0  # the end of the run is always evaluated
        due = in_loop + final
        if self._eval_seconds:
            one = sum(self._eval_seconds) / len(self._eval_seconds)
        else:
            one = self.eval_data.num_batches * step_s / cfg.grad_accum / 3
        return eta + due * one

    def _elapsed_wall(self) -> float:
        """wall_s including the part of train() still running."""
        running = time.perf_counter() - self._train_start if self._train_start is not None else 0.0
        return self.wall_s + running

    def _progress_bar(self):
        """tqdm only on a terminal: in a job log its carriage returns are noise (the log lines carry it all)."""
        if not self.job.train.progress or not self.dist.is_main or not sys.stderr.isatty():
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.job.train.max_steps, initial=self.state.step, desc="train", unit="step")

    # -- evaluation and samples ---------------------------------------------------------------------------
    def evaluate(self) -> Optional[dict]:
        """Eval loss/perplexity on the held-out set; marks (and saves) a new best, counts early-stop patience.
        None when a stop signal cut it short (within one eval batch)."""
        start = time.perf_counter()
        self.model.eval()
        with self._pausing("evaluation"):
            result = evaluate_loss(
                self.train_module,
                self.eval_data.batches(),
                self.device,
                self._prepare,
                self._autocast,
                stop=self._stop_requested,
                on_batch=EvalProgress(self.state.step, self.eval_data.num_batches, enabled=self.dist.is_main),
            )
        self.model.train()
        if result is not None:
            self._eval_seconds.append(time.perf_counter() - start)
            self._check_eval_budget(self._eval_seconds[-1])
        if result is None:  # a stop signal: no eval record (a partial set is no loss to compare), on to the save
            self._cut_short("evaluation", start)
            return None
        s, cfg = self.state, self.job.train
        record = {"step": s.step, **result}
        s.evals.append(record)
        self.metrics.scalars({"loss": result["loss"], "ppl": result["ppl"]}, s.step, kind="eval")
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
        if improved and self._saves_best:
            path = self.save() if self._saved_step != s.step else step_dir(self.out_dir / CHECKPOINTS, s.step)
            if self.dist.is_main:
                mark_best(path.parent, path)
            self._prune()  # the previous best may be past keep_last now
        if cfg.early_stop_patience and s.evals_since_best >= cfg.early_stop_patience:
            self.stopped_early = True
            log.warning(
                "early stop at step %d: no better eval loss in %d evaluations (best %.4f at step %d)",
                s.step,
                s.evals_since_best,
                s.best_eval_loss,
                s.best_step,
            )
        self._last_eval_s = time.perf_counter() - start
        self._paused_s += self._last_eval_s
        return record

    def _check_eval_budget(self, eval_s: float) -> None:
        """After the first in-loop evaluation: warn when one costs more than ~10 % of the training between two, and
        say which train.eval_batches would fit."""
        cfg = self.job.train
        done = self.state.step - self._loop_start_step
        if len(self._eval_seconds) != 1 or not cfg.eval_every or not done or self.state.step >= cfg.max_steps:
            return
        step_s = (time.perf_counter() - self._loop_start - self._paused_s - eval_s) / done
        warning = eval_budget_warning(eval_s, self.eval_data.num_batches, cfg.eval_every, step_s, cfg.eval_batches)
        if warning and self.dist.is_main:
            log.warning("eval: %s", warning)

    @property
    def _saves_best(self) -> bool:
        """train.save_best, in a run that writes checkpoints at all (save_final or save_every)."""
        cfg = self.job.train
        return cfg.save_best and bool(cfg.save_final or cfg.save_every)

    def sample(self) -> Optional[list[str]]:
        """Greedy continuations of train.sample_prompts, written to TensorBoard text (samples/<i>); None when a
        stop signal cut it short (within one generated token)."""
        start = time.perf_counter()
        cfg = self.job.train

        def logits_of(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            # through the root module (FSDP2/DDP hooks run there): every rank calls it with the same row
            batch = {"input_ids": input_ids, "position_ids": position_ids}
            if self.context_parallel is not None:  # the row split over the cp ranks, the logits put together
                return self.context_parallel.logits(self.train_module, self.model, batch)
            return self.train_module(batch, logits=True)

        self.model.eval()
        with self._autocast(), self._pausing("sampling"):
            # rows in whole blocks per cp rank (the context-parallel split needs cp x block_size)
            texts = greedy_continue(
                logits_of,
                self.tokenizer,
                cfg.sample_prompts,
                cfg.sample_tokens,
                self.device,
                pad_to=self.job.attn.block_size * self._cp,
                stop=self._stop_requested,
            )
        self.model.train()
        if texts is None:
            self._cut_short("sampling", start)
            return None
        for i, (prompt, text) in enumerate(zip(cfg.sample_prompts, texts)):
            self.metrics.text(f"samples/{i}", f"**{prompt}**{text}", self.state.step)
            self.metrics.record({"type": "sample", "step": self.state.step, "prompt": prompt, "text": text})
        self._last_sample_step = self.state.step
        self._paused_s += time.perf_counter() - start
        return texts

    @contextlib.contextmanager
    def _pausing(self, activity: str) -> Iterator[None]:
        """Mark an evaluation or sampling pause (the signal handler then says it stops at the next batch/token)."""
        self._pause = activity
        try:
            yield
        finally:
            self._pause = None

    def _stop_requested(self) -> bool:
        """Asked between eval batches and sampled tokens: whether a stop signal came. Under torchrun the ranks agree
        through one small all-reduce (each forward there is a collective: all ranks must leave after the same one);
        its cost is nothing beside an eval batch's or a whole row's forward."""
        mine = self._stop_signal is not None
        if not torch.distributed.is_initialized():
            return mine
        vote = torch.tensor([float(mine)], device=self.device)
        torch.distributed.all_reduce(vote)
        self._stop_agreed = self._stop_agreed or bool(vote.item() > 0)
        return self._stop_agreed

    def _cut_short(self, activity: str, start: float) -> None:
        """An evaluation or sampling a signal stopped: the run ends as interrupted (saved, 128 + signal), so a
        requeue with train.resume=auto does what is left."""
        self._interrupted = True
        self._last_eval_s = time.perf_counter() - start
        self._paused_s += self._last_eval_s
        log.warning("signal: %s at step %d stopped; saving and exiting", activity, self.state.step)

    def _should_stop(self) -> bool:
        if torch.distributed.is_initialized():
            return self._stop_agreed
        return self._stop_signal is not None

    @contextlib.contextmanager
    def stop_on_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM finish the current step, save and stop; a second signal only says the save is still
        running; a third gives up the save: the previous handler runs (Ctrl-C raises KeyboardInterrupt, SIGTERM
        ends the process). run_training holds this over the summary write too. The old handlers come back at
        the end."""
        if self._handling_signals:
            yield
            return
        previous = {}

        def request_stop(signum: int, frame: object) -> None:
            self._signals += 1
            if self._stop_signal is None:
                self._stop_signal = signum
                log.warning(
                    "signal %d: %s, then saving and exiting with status %d",
                    signum,
                    f"stopping the {self._pause} at its next {'batch' if self._pause == 'evaluation' else 'token'}"
                    if self._pause
                    else f"finishing step {self.state.step + 1}",
                    128 + signum,
                )
            elif self._signals == 2:
                log.warning(
                    "signal %d again: still finishing and saving (step %d); exiting when the checkpoint "
                    "and summary are written. A third signal aborts and loses this save (the previous "
                    "checkpoint stays intact)",
                    signum,
                    self.state.step,
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
        self._handling_signals = True
        try:
            yield
        finally:
            self._handling_signals = False
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @property
    def exit_code(self) -> int:
        """0, or 128 + signal after a signal-stopped run (what schedulers read as preemption, not completion).
        A rank stopped because another rank had the signal reports SIGTERM, the usual preemption signal. A signal
        during the final save leaves a complete run: 0; one that cuts the final evaluation short (_cut_short)
        marks the run interrupted (its summary has no eval loss): 128 + signal."""
        if not self._interrupted:
            return 0
        return 128 + (self._stop_signal if self._stop_signal is not None else signal.SIGTERM)

    # -- results, checkpoints, resume ---------------------------------------------------------------------
    def summary(self) -> dict:
        """The numbers summary.json reports."""
        s = self.state
        wall = max(self.train_s, 1e-9)  # rates are of training time (evaluations and saves are not steps)
        return {
            "steps": s.step,
            "tokens_seen": s.tokens_seen,
            "useful_tokens_seen": s.useful_tokens_seen,
            "useful_token_fraction": s.useful_tokens_seen / max(1, s.tokens_seen),
            "tokens_per_s": s.tokens_seen / wall,
            "useful_tokens_per_s": s.useful_tokens_seen / wall,
            # MFU: model FLOPs (6N-style + attended pairs, useful tokens); HFU: FLOPs executed (with recompute)
            "mfu": utilization(s.model_flops, wall, self.job.hardware.peak_tflops),
            "hfu": utilization(s.hardware_flops, wall, self.job.hardware.peak_tflops),
            "model_flops": s.model_flops,
            "hardware_flops": s.hardware_flops,
            "initial_loss": s.losses[0] if s.losses else None,
            "final_loss": s.losses[-1] if s.losses else None,
            "losses": list(s.losses),
            "skipped_nonfinite_steps": s.skipped_nonfinite,
            "block_density": s.block_density_sum / max(1, s.step) if self._patched_attention else None,
            "attention": self.attn.as_dict() if self.attn is not None else None,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "wall_s": self._elapsed_wall(),  # the whole run, evaluations included
            "train_s": self.train_s,  # training steps only (tokens/s, MFU)
            "eval_s": sum(self._eval_seconds),  # evaluations of this process
            "stopped_by_signal": self._stop_signal,
            "status": "interrupted" if self._interrupted else "ok",
            "stopped_early": self.stopped_early,
            "eval": self._eval_summary(),
            "exit_code": self.exit_code,
        }

    def _eval_summary(self) -> Optional[dict]:
        s = self.state
        if not s.evals:
            return None
        best = step_dir(self.out_dir / CHECKPOINTS, s.best_step)
        return {
            "loss": s.evals[-1]["loss"],
            "ppl": s.evals[-1]["ppl"],
            "best_loss": s.best_eval_loss,
            "best_step": s.best_step,
            "best_checkpoint": str(best) if self._saves_best else None,
            "history": list(s.evals),
        }

    def _hparams(self) -> dict:
        j = self.job
        return {
            "model": j.model.name,
            "attn": j.attn.mode,
            "backend": self.attn.backend.value if self.attn is not None else "hf",
            "memory": j.memory.policy,
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

    def _hparam_metrics(self, summary: dict) -> dict:
        """The numbers TensorBoard's HPARAMS tab compares runs by (the held-out losses when there are evaluations)."""
        final = summary["final_loss"]
        metrics = {
            "final_loss": float("nan") if final is None else final,
            "useful_tokens_per_s": summary["useful_tokens_per_s"],
        }
        if summary["eval"]:
            metrics.update(eval_loss=summary["eval"]["loss"], best_eval_loss=summary["eval"]["best_loss"])
        return metrics

    def trainer_state(self) -> dict:
        """Everything besides the weights that an exact resume needs."""
        return {
            "train": asdict(self.state),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "rng": _rng_state(),
            "wall_s": self._elapsed_wall(),
            "train_s": self.train_s,
            "max_steps": self.job.train.max_steps,  # the schedule's length: a resume with another one is told
            "data_plan": dict(self.data_plan),
        }

    def save(self) -> Path:
        """Checkpoint to out_dir/checkpoints/step_<N> (every rank calls this; rank 0 writes the weights)."""
        lora = self.job.model.lora
        merge = lora if lora.r > 0 and self.job.train.merge_lora_on_save else None
        weights = exported_weights(self.optimizer, self.model)
        self._check_finite(weights)
        path = save_checkpoint(
            self.out_dir / CHECKPOINTS,
            self.state.step,
            self.model,
            self.tokenizer,
            self.trainer_state(),
            merge_lora=merge,
            weights=weights,
            finite_checked=True,
            base_dir=Path(self.job.model.path) if merge is not None and self.job.model.loads_weights else None,
        )
        self._saved_step = self.state.step
        self._prune()
        return path

    def _check_finite(self, weights: Optional[dict]) -> None:
        """Refuse to save NaN/Inf weights or optimizer states (UserError naming them and the likely optim.* cause;
        every rank raises, as the save is collective)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        named = [*self.model.named_parameters(), *optimizer_tensors(self.optimizer, names), *(weights or {}).items()]
        bad = nonfinite_names(named)
        count = len(bad)
        if torch.distributed.is_initialized():
            total = torch.tensor([float(count)], device=self.device)
            torch.distributed.all_reduce(total)
            count = int(total.item())
        if count:
            raise UserError(nonfinite_message(self.state.step, bad, self.job.optim))

    def _prune(self) -> None:
        """train.keep_last: the newest checkpoints stay, and so do the best and the resumed-from one."""
        if self.dist.is_main:
            prune_checkpoints(self.out_dir / CHECKPOINTS, self.job.train.keep_last, protect=(self.resumed_from,))

    def resume(self, spec: str) -> Optional[Path]:
        """train.resume: auto (newest verifying checkpoint under out_dir/checkpoints, if any) or a step_<N> dir."""
        path = resolve_resume(spec, self.out_dir / CHECKPOINTS, bool(self.job.train.output_dir))
        if path is None:  # a requeued run that never saved starts again: its earlier records would repeat
            self.metrics.truncate_after(0)
            return None
        state = load_checkpoint_state(path)
        new_data = self._check_data_plan(state.get("data_plan", {}), path)  # before the weights: a cheap refusal
        load_checkpoint_weights(path, self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The saved lr came from the old schedule; re-derive it so a changed train.max_steps applies at once.
        saved_lr = float(self.optimizer.param_groups[0]["lr"])
        for group, base_lr, factor in zip(
            self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas
        ):
            group["lr"] = base_lr * factor(self.scheduler.last_epoch)
        self._warn_schedule_change(state, saved_lr)
        if not new_data:
            try:
                self.loader.load_state_dict(state["data"])
            except ValueError as e:
                raise UserError(f"train.resume={spec}: {e}") from None
        _set_rng_state(state["rng"])
        known = {f.name for f in dataclasses.fields(TrainState)}
        saved = state["train"]
        if "block_sparsity_sum" in saved:  # checkpoints written before the rename
            saved = {**saved, "block_density_sum": saved["block_sparsity_sum"]}
        self.state = TrainState(**{k: v for k, v in saved.items() if k in known})
        self.wall_s = state.get("wall_s", 0.0)
        self.train_s = state.get("train_s", self.wall_s)  # older checkpoints: wall_s was training time only
        self.resumed_from = path
        self._saved_step = self.state.step
        self.metrics.truncate_after(self.state.step)  # the killed run's records past its checkpoint
        log.info("resumed from %s at step %d", path, self.state.step)
        return path

    def _warn_schedule_change(self, state: dict, saved_lr: float) -> None:
        """A resume whose schedule differs from the saved run's (train.max_steps, optim.*) jumps the lr: say so."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        before = state.get("max_steps")
        if math.isclose(lr, saved_lr, rel_tol=1e-6, abs_tol=1e-12) and before in (None, self.job.train.max_steps):
            return
        changed = f"train.max_steps {before} -> {self.job.train.max_steps}" if before else "the lr schedule"
        log.warning(
            "resume: %s changed: the schedule is re-derived over %d steps, so the lr of step %d is %.3g (the saved "
            "run's was %.3g); the warmup and decay are those of the new length.",
            changed,
            self.job.train.max_steps,
            state["train"]["step"] + 1,
            lr,
            saved_lr,
        )

    def _check_data_plan(self, saved: dict, path: Path) -> bool:
        """Refuse a resume onto a different data stream unless train.resume_new_data; True = start the new data
        from its first row."""
        changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in self.data_plan.items() if saved.get(k) != v]
        if not changed:
            return False
        if not self.job.train.resume_new_data:
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


def _tqdm_logging():
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
