"""The training loop: accumulate, clip, step, schedule, log, checkpoint, resume."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from flexengine.core.errors import UserError
from flexengine.core.parallel_spec import ReduceEvery
from flexengine.data.targets import count_valid_targets
from flexengine.loop.components import Components, TrainerSetup
from flexengine.loop.flops import TrainFlops, layer_attended_pairs
from flexengine.loop.hooks import StepHooks
from flexengine.loop.nonfinite import suspect_settings
from flexengine.loop.optim import clip_gradients, describe_resumed_schedule, describe_schedule, last_backward
from flexengine.loop.profiling import start_profiler
from flexengine.loop.progress import hparam_metrics, tqdm_logging
from flexengine.surgery.applied import attention_spec
from flexengine.surgery.attention.patch import MASK_KWARG
from flexengine.surgery.compile import verify_compiled_blocks
from flexengine.surgery.parallel import grad_norm_value, gradient_sync

log = logging.getLogger(__name__)


def rows_counted_once(summed: torch.Tensor, cp: int) -> torch.Tensor:
    """Counts over the job's rows from their all-reduced sum over ranks: the cp ranks of a context-parallel group
    read the same rows, so the sum holds each row cp times (exact: integer counts in float64)."""
    return summed / cp


@dataclass(frozen=True)
class _Window:
    """What one accumulation window's forward/backward leaves for the step's one host sync."""

    loss: torch.Tensor  # the window's mean token loss over every rank (device)
    block_density: torch.Tensor  # mean BlockMask density of its micro-batches (device; nan without masks)
    masked: bool  # whether flexengine's masks were built (else block_density means nothing)
    model_flops: float
    hardware_flops: float | torch.Tensor  # a device tensor under flex (executed blocks: no host sync)


class Trainer:
    """Runs `train.max_steps` optimizer steps of a patched model over a RowLoader. `setup` holds the config sections
    and resolved specs the run reads; its components own their own state and are handed to it (built by
    loop/components.build_components: run.py's build_trainer): the Checkpointer (save, resume), the Evaluator
    (held-out evaluations, samples, early stopping), Progress (the run clock, the step line) and StopSignals. Only
    this class writes its own fields."""

    def __init__(self, setup: TrainerSetup, components: Components) -> None:
        self.setup, self.dist, self.parallel = setup, components.dist, setup.parallel
        # several ranks accumulating: when to sync is a choice (the planner's), never a guess
        if self.parallel.reduce_every is ReduceEvery.AUTO and self.dist.world_size > 1 and setup.train.grad_accum > 1:
            raise ValueError(
                "Trainer: parallel.reduce_every=auto reached the loop unresolved over several ranks; the planner "
                "chooses it (flexengine.run.build_trainer), or set parallel.reduce_every=window|micro_batch"
            )
        self.forward = components.forward
        self.model, self.device = self.forward.model, self.forward.device
        self.checkpointer = components.checkpointer  # the run's data, tokenizer and directory: its checkpoints'
        self.loader, self.tokenizer = self.checkpointer.loader, self.checkpointer.tokenizer
        self.out_dir = self.checkpointer.root.parent
        self.train_module, self.precision = self.forward.train_module, self.forward.precision
        self.optimizer, self.scheduler = components.optimizer, components.scheduler
        self.state, self.metrics, self.progress = components.state, components.metrics, components.progress
        self.signals, self.evaluator = components.signals, components.evaluator
        self.attn = attention_spec(self.model)  # None: HF's own attention, untouched
        # recompute: what the memory surgery recorded; the loss's lm_head re-run: loss.chunk_size and loss.fused
        self.flops = TrainFlops(self.model, setup.loss.chunk_size, setup.loss.fused)
        self._interrupted = False  # a signal stopped the loop, or cut an evaluation/sampling short (not: a signal
        # that came after the last step, during the final save)
        self.hooks: list[StepHooks] = []  # observers of each step (the doctor); none in a plain run
        # what the run was built from, for summary.json: the data and the activation-memory reports
        self.data_report, self.memory_report = setup.data_report, setup.memory_report

    def add_hooks(self, hooks: StepHooks) -> None:
        """Register step callbacks (flexengine.loop.hooks.StepHooks)."""
        self.hooks.append(hooks)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
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
    def _share(self, count: float) -> float:
        """This rank's share of a count over its rows, for its FLOPs (all of it, unless context parallelism splits
        the rows)."""
        return count if self.forward.cp == 1 else count / self.forward.cp

    def train_step(self) -> dict:
        """Forward/backward over grad_accum micro-batches, then clip and step. Returns step metrics."""
        for h in self.hooks:
            h.on_step_start(self, self.state.step + 1)
        with self._phase("data"):
            micro_batches = [self.loader.next_batch() for _ in range(self.setup.train.grad_accum)]
        counts = self._window_counts(micro_batches)
        rows = rows_counted_once(counts[:3], self.forward.cp)  # valid targets, tokens, useful tokens of the job's rows
        window = self._accumulate(micro_batches, n_valid=rows[0].clamp(min=1).float())
        clip = self.setup.optim.grad_clip if self.setup.optim.grad_clip > 0 else float("inf")
        grad_norm = grad_norm_value(clip_gradients(self.optimizer, self.model.parameters(), clip))
        # the one host sync per step: loss, grad norm, density, flex's executed FLOPs and the job's token counts
        # come back together (float64: token counts stay exact integers)
        on = window.loss.device
        loss_value, norm_value, density_value, stop_votes, hardware_flops, tokens, useful = torch.stack(
            [
                window.loss.double(),
                grad_norm.double().to(on),
                window.block_density.double().to(on),
                counts[3],
                torch.as_tensor(window.hardware_flops, dtype=torch.float64, device=on),
                rows[1],
                rows[2],
            ]
        ).tolist()
        self.signals.agreed = stop_votes > 0
        # this update's lr (read before the scheduler moves on); float(): torchao keeps it as a tensor, and the
        # metrics, the step line and metrics.jsonl need a number
        lr = float(self.optimizer.param_groups[0]["lr"])
        self._update(loss_value, norm_value)
        metrics = {  # tokens: the whole job's rows, each once (tokens/s is the job's throughput, MFU per device)
            "loss": loss_value,
            "grad_norm": norm_value,
            "tokens": int(tokens),
            "useful_tokens": int(useful),
            "lr": lr,
            "block_density": density_value if window.masked else None,
            "model_flops": window.model_flops,
            "hardware_flops": hardware_flops,
        }
        for h in self.hooks:
            h.on_step_end(self, self.state.step + 1, metrics)
        return metrics

    def _window_counts(self, micro_batches: list[dict]) -> torch.Tensor:
        """[valid targets, tokens, useful tokens, stop votes] of the accumulation window, summed over the ranks.

        The loss is sum(token CE) / valid tokens of the whole window: each backward() adds its share. One
        all-reduce carries the window's valid-token count and the ranks' stop votes (a signal may reach the ranks
        a step apart; all of them must stop after the same step, or the collectives would hang). The same
        all-reduce sums the rows' tokens and useful tokens: the metrics count the whole job's rows. (Host batches:
        these counts need no device sync.)"""
        counts = torch.tensor(
            [
                float(sum(count_valid_targets(b["labels"]) for b in micro_batches)),
                sum(b["input_ids"].numel() for b in micro_batches),
                sum(int(b["useful_tokens"]) for b in micro_batches),
                float(self.signals.signal is not None),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        return counts

    def _accumulate(self, micro_batches: list[dict], n_valid: torch.Tensor) -> _Window:
        """Forward and backward of every micro-batch of the window; its loss (over all ranks), mask density and
        FLOPs, still on the device (train_step reads them back in its one sync)."""
        loss_sum = torch.zeros((), device=self.device)
        density, model_flops, hardware_flops = [], 0.0, 0.0
        for i, host_batch in enumerate(micro_batches):
            # tensors only (pinned by the loader on CUDA, so non_blocking really is); host facts stay here
            batch = {
                k: v.to(self.device, non_blocking=True) for k, v in host_batch.items() if isinstance(v, torch.Tensor)
            }
            with self._phase("mask"):
                batch, mask_kwargs = self.forward.prepare(batch)  # one mask, shared by every layer
            model_flops_mb, hardware_flops_mb = self._flops(host_batch, mask_kwargs)
            model_flops, hardware_flops = model_flops + model_flops_mb, hardware_flops + hardware_flops_mb
            loss_sum += self._forward_backward(batch, mask_kwargs, n_valid, last=i == len(micro_batches) - 1)
            # blocks that must run compiled did (a silent eager fallback would keep SAC's cache on the device)
            verify_compiled_blocks(self.model, self.memory_report.get("activation_offloaded_bytes"))
            if mask_kwargs:
                density.append(mask_kwargs[MASK_KWARG].block_density)
        loss = loss_sum / n_valid
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
        block_density = torch.stack(density).float().mean() if density else torch.full((), float("nan"))
        return _Window(loss, block_density, bool(density), model_flops, hardware_flops)

    def _forward_backward(self, batch: dict, mask_kwargs: dict, n_valid: torch.Tensor, last: bool) -> torch.Tensor:
        """One micro-batch's forward and backward (`last`: the window's final one); its summed token loss."""
        # ranks reduce gradients once per window, in the last micro-batch's backward (DDP no_sync / FSDP2),
        # or in every backward (parallel.reduce_every=micro_batch: no unsharded gradients held between them)
        with gradient_sync(self.train_module, enabled=last or self.parallel.reduces_every_micro_batch):
            with self._phase("forward"), self.forward.compute_context():
                micro_loss = self.train_module(batch, **mask_kwargs)
            # the window's gradients are final in this backward: a host optimizer starts its downloads in it
            with self._phase("backward"), last_backward(self.optimizer, enabled=last):
                (micro_loss / n_valid).backward()
        return micro_loss.detach()

    def _update(self, loss_value: float, norm_value: float) -> None:
        """Step the optimizer and the schedule on finite numbers; else skip the step (counted) or stop."""
        if math.isfinite(loss_value) and math.isfinite(norm_value):
            with self._phase("optimizer"):
                self.optimizer.step()
            self.scheduler.step()  # counts updates: a skipped step leaves the schedule where it was
        elif self.setup.train.skip_nonfinite:
            self.state.skipped_nonfinite += 1
            log.warning("step %d: non-finite loss/grad (%s), step skipped", self.state.step + 1, loss_value)
        else:
            raise UserError(
                f"step {self.state.step + 1}: loss is {loss_value} (grad norm {norm_value}); training stopped "
                f"before the update. Likely cause: {suspect_settings(self.setup.optim)}. Or set "
                "train.skip_nonfinite=true to skip (and count) such steps."
            )
        self.optimizer.zero_grad(set_to_none=True)

    def _flops(self, host_batch: dict, mask_kwargs: dict) -> tuple:
        """(model, hardware) FLOPs of one micro-batch; hardware is a device tensor under flex (no host sync)."""
        B, S = host_batch["input_ids"].shape
        predicting = len(host_batch["predicting_index"])
        pairs = layer_attended_pairs(self.attn, host_batch["document_lengths"], len(self.flops.blocks))
        model = self.flops.model_flops(host_batch["useful_tokens"], predicting, pairs)
        # HF's own attention has no masks of ours: its causal kernel computes the causal square of each row
        # (under context parallelism: this rank's mask, its share of the tokens)
        executed = mask_kwargs[MASK_KWARG].executed_pairs if mask_kwargs else B * S * (S + 1) // 2
        return self._share(model), self.flops.hardware_flops(self._share(B * S), self._share(predicting), executed)

    # -- the loop -----------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to train.max_steps (or a stop signal, or early stopping); returns the run summary."""
        cfg, state = self.setup.train, self.state
        if self.dist.is_main:  # here, not at construction: a resume has fitted the schedule by now
            log.info("optim: %s", self._schedule_line())
        self.progress.start_run()
        with self.stop_on_signals():  # through the final save: a signal must not cut it short
            self._loop()
            self._interrupted = self.signals.should_stop()
            if self._interrupted:
                by = self.signals.signal or "(on another rank)"
                log.warning("stopped by signal %s after step %d; saving", by, state.step)
            elif self.evaluator.due_at_end(state.step):
                self.evaluate()  # the end of the run is always evaluated
            if not self._interrupted and self.evaluator.samples_at_end(state.step):
                self.sample()
            # a signal that cut the final evaluation or sampling short ends the run interrupted too
            self._interrupted = self._interrupted or self.evaluator.cut_short
            # a signal before step 1 leaves nothing trained to save (a resume starts fresh, the same thing); an
            # interrupted run saves even without save_final: the requeue resumes from it
            unsaved = self.checkpointer.saved_step != state.step and state.step > 0
            if (cfg.save_final or self._interrupted) and unsaved:
                self.save(completes_run=not self._interrupted)
            result = self.summary()
            self.metrics.hparams(self.setup.hparams, hparam_metrics(result))
            self.metrics.close()
        return result

    def _schedule_line(self) -> str:
        """The schedule in words; a resumed run's says where it resumed and the lr it goes on at."""
        if self.checkpointer.resumed_from is None:
            return describe_schedule(self.setup.optim, self.setup.train.max_steps)
        lr = float(self.optimizer.param_groups[0]["lr"])
        done = self.scheduler.last_epoch
        knots = self.scheduler.state_dict()["knots"]  # optim.apply_knots keeps them on the scheduler (and its state)
        return describe_resumed_schedule(self.setup.optim, self.setup.train.max_steps, knots, done, lr)

    def _loop(self) -> None:
        cfg = self.setup.train
        bar = self.progress.bar(self.state.step)
        self.model.train()
        profiler = (
            start_profiler(self.out_dir, cfg.max_steps - self.state.step, cfg.profile_steps, self.device)
            if cfg.profile
            else None
        )
        self.progress.start_loop(self.state.step)
        with tqdm_logging() if bar is not None else contextlib.nullcontext():
            while self.state.step < cfg.max_steps and not self.signals.should_stop() and not self.stopped_early:
                self.progress.start_step()
                m = self.train_step()
                if profiler is not None:
                    profiler.step()
                self._count(m)
                self.progress.count(m)
                step = self.state.step
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    self.progress.log_step(self.metrics, m, step, eta_s=self.eta_s(), device=self.device)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{m['loss']:.3f}")
                if cfg.save_every and step % cfg.save_every == 0:
                    self.save()
                if self.evaluator.should_evaluate(step):
                    self.evaluate()
                    self.progress.exclude_last_pause()  # evaluation is not training time
                if self.evaluator.should_sample(step):
                    self.sample()
        self.progress.end_loop()
        if profiler is not None:
            profiler.stop()
        if bar is not None:
            bar.close()

    def _count(self, m: dict) -> None:
        s = self.state
        s.step += 1
        s.losses.append(m["loss"])
        s.tokens_seen += m["tokens"]
        s.useful_tokens_seen += m["useful_tokens"]
        s.block_density_sum += m["block_density"] or 0.0
        s.model_flops += m["model_flops"]
        s.hardware_flops += m["hardware_flops"]

    @property
    def stopped_early(self) -> bool:
        """train.early_stop_patience ran out (the Evaluator's verdict)."""
        return self.evaluator.stopped_early

    def eta_s(self) -> float:
        """Seconds left: the remaining steps at this launch's mean training step time, plus the evaluations still
        due (the Evaluator's estimate)."""
        step_s = self.progress.mean_step_s(self.state.step)
        steps_left = self.setup.train.max_steps - self.state.step
        return step_s * steps_left + self.evaluator.seconds_left(self.state.step, step_s)

    @property
    def exit_code(self) -> int:
        """0, or 128 + signal after a signal-stopped run (what schedulers read as preemption, not completion).
        A rank stopped because another rank had the signal reports SIGTERM, the usual preemption signal. A signal
        during the final save leaves a complete run: 0; one that cuts the final evaluation short (Evaluator.cut_short)
        marks the run interrupted (its summary has no eval loss): 128 + signal."""
        if not self._interrupted:
            return 0
        return 128 + (self.signals.signal if self.signals.signal is not None else signal.SIGTERM)

    # -- the components: evaluations/samples, summary, checkpoints, stop signals -------------------------------
    def evaluate(self) -> Optional[dict[str, Any]]:
        """Eval loss/perplexity on the held-out set (Evaluator.evaluate)."""
        return self.evaluator.evaluate()

    def sample(self) -> Optional[list[str]]:
        """Greedy continuations of train.sample_prompts (Evaluator.sample)."""
        return self.evaluator.sample()

    def summary(self) -> dict[str, Any]:
        """The numbers summary.json reports: the clock's training numbers, the evaluations, how the run ended."""
        return {
            **self.progress.summary(self.attn, self.device),
            "eval_s": sum(self.evaluator.eval_seconds),  # evaluations of this process
            "stopped_by_signal": self.signals.signal,
            "status": "interrupted" if self.exit_code else "ok",
            "stopped_early": self.evaluator.stopped_early,
            "eval": self.evaluator.summary(),
            "exit_code": self.exit_code,
        }

    def trainer_state(self) -> dict[str, Any]:
        """Everything besides the weights that an exact resume needs (Checkpointer.state_dict)."""
        return self.checkpointer.state_dict()

    def save(self, completes_run: bool = False) -> Path:
        """Checkpoint this step to out_dir/checkpoints/step_<N> (every rank calls this; rank 0 writes the weights).
        completes_run: the final save of a run that did all its steps (a signal during it names that save)."""
        with self.signals.saving(self.state.step, completes_run):
            return self.checkpointer.save(self.state.step)

    def resume(self, spec: Optional[str] = None) -> Optional[Path]:
        """train.resume (or `spec`): auto (newest verifying checkpoint under out_dir/checkpoints, if any) or a
        step_<N> dir (Checkpointer.resume)."""
        return self.checkpointer.resume(spec)

    def stop_on_signals(self) -> contextlib.AbstractContextManager[None]:
        """SIGINT/SIGTERM finish the step, save and stop (flexengine.loop.signals.StopSignals.handle; it nests)."""
        return self.signals.handle()
