"""The training loop: accumulate, clip, step, schedule, log, checkpoint, resume."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from flexengine.applied import attention_spec
from flexengine.attention import MASK_KWARG, mask_kwargs
from flexengine.checkpoint import find_latest_checkpoint
from flexengine.config import JobConfig
from flexengine.data.loader import RowLoader
from flexengine.errors import UserError
from flexengine.hooks import StepHooks
from flexengine.loss import count_valid_targets
from flexengine.metrics import MetricsWriter, peak_memory_bytes, train_flops_per_token
from flexengine.optim import build_optimizer, build_scheduler
from flexengine.parallel import (
    DistInfo,
    LossForward,
    grad_norm_value,
    gradient_sync,
    load_checkpoint_all_ranks,
    save_checkpoint_all_ranks,
)
from flexengine.profiling import start_profiler

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters that travel with checkpoints."""

    step: int = 0
    tokens_seen: int = 0  # row slots processed, padding included
    useful_tokens_seen: int = 0  # real document tokens processed
    losses: list = field(default_factory=list)  # per optimizer step
    skipped_nonfinite: int = 0
    block_sparsity_sum: float = 0.0


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """Runs `train.max_steps` optimizer steps of a patched model over a RowLoader."""

    def __init__(self, job: JobConfig, model: nn.Module, tokenizer, loader: RowLoader, *, out_dir: Path,
                 device: torch.device, dist: Optional[DistInfo] = None, train_module: Optional[nn.Module] = None):
        self.job, self.model, self.tokenizer, self.loader = job, model, tokenizer, loader
        self.out_dir, self.device, self.dist = out_dir, device, dist if dist is not None else DistInfo()
        # what forward/backward goes through: the FSDP/DDP root under torchrun, else a plain loss module
        self.train_module = train_module if train_module is not None else LossForward(model, job.loss.chunk_size)
        self.optimizer = build_optimizer(model, job.optim, device)
        self.scheduler = build_scheduler(self.optimizer, job.optim, job.train.max_steps)
        self.state = TrainState()
        self.metrics = MetricsWriter(out_dir / "tb" if self.dist.is_main else None)
        self.attn = attention_spec(model)  # None: HF's own attention, untouched
        self.flops_per_token = train_flops_per_token(model, job.data.seq_len)
        self._stop_signal: Optional[int] = None  # set by this process's signal handler
        self._stop_agreed = False  # some rank had a signal at the start of the last step (all ranks agree)
        self.wall_s = 0.0
        self.hooks: list[StepHooks] = []  # observers of each step (the doctor); none in a plain run

    def add_hooks(self, hooks: StepHooks) -> None:
        """Register step callbacks (flexengine.hooks.StepHooks)."""
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
    def _mask_kwargs(self, batch: dict) -> dict:
        """Build the batch's attention mask once, here, so every layer shares it (and we can log sparsity)."""
        return mask_kwargs(self.model, batch["document_ids"])

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
        counts = torch.stack([sum(count_valid_targets(b["labels"]) for b in micro_batches).double(),
                              torch.tensor(float(self._stop_signal is not None), dtype=torch.float64)]).to(self.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        n_valid = counts[0].clamp(min=1).float()
        loss_sum = torch.zeros((), device=self.device)
        sparsity = []
        for i, batch in enumerate(micro_batches):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            with self._phase("mask"):
                mask_kwargs = self._mask_kwargs(batch)
            # ranks reduce gradients once per window, in the last micro-batch's backward (DDP no_sync / FSDP2)
            with gradient_sync(self.train_module, enabled=i == len(micro_batches) - 1):
                with self._phase("forward"), self._autocast():
                    micro_loss = self.train_module(batch, **mask_kwargs)
                with self._phase("backward"):
                    (micro_loss / n_valid).backward()
            loss_sum += micro_loss.detach()
            if mask_kwargs:
                sparsity.append(mask_kwargs[MASK_KWARG].block_sparsity)
        loss = loss_sum / n_valid
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
        grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.job.optim.grad_clip if self.job.optim.grad_clip > 0 else float("inf")
        ))
        block_sparsity = torch.stack(sparsity).float().mean() if sparsity else torch.full((), float("nan"))
        # the one host sync per step: loss, grad norm and sparsity come back together
        loss_value, norm_value, sparsity_value, stop_votes = torch.stack(
            [loss.float(), grad_norm.float().to(loss.device), block_sparsity.to(loss.device), counts[1].float()]
        ).tolist()
        self._stop_agreed = stop_votes > 0
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if finite:
            with self._phase("optimizer"):
                self.optimizer.step()
        elif self.job.train.skip_nonfinite:
            self.state.skipped_nonfinite += 1
            log.warning("step %d: non-finite loss/grad (%s), step skipped", self.state.step + 1, loss_value)
        else:
            raise UserError(
                f"step {self.state.step + 1}: loss is {loss_value} (grad norm {norm_value}); training stopped "
                "before the update. Lower optim.lr, check the data, or set train.skip_nonfinite=true to skip "
                "(and count) such steps."
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        tokens = sum(b["input_ids"].numel() for b in micro_batches)
        useful = sum(int(b["useful_tokens"]) for b in micro_batches)
        metrics = {
            "loss": loss_value, "grad_norm": norm_value, "tokens": tokens, "useful_tokens": useful,
            "block_sparsity": sparsity_value if sparsity else None,
        }
        for h in self.hooks:
            h.on_step_end(self, self.state.step + 1, metrics)
        return metrics

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- the loop -----------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to train.max_steps (or a stop signal); returns the run summary."""
        cfg = self.job.train
        with self._signals_request_stop():
            self._loop()
        stopped = self._should_stop()
        if stopped:
            log.warning("stopped by signal %s after step %d; saving", self._stop_signal or "(on another rank)",
                        self.state.step)
        already_saved = cfg.save_every and self.state.step % cfg.save_every == 0
        if (cfg.save_final or stopped) and not already_saved:
            self.save()
        summary = self.summary()
        self.metrics.hparams(self._hparams(), {"final_loss": summary["final_loss"] or float("nan"),
                                               "useful_tokens_per_s": summary["useful_tokens_per_s"]})
        self.metrics.close()
        return summary

    def _loop(self) -> None:
        cfg = self.job.train
        progress = self._progress_bar()
        self.model.train()
        profiler = (start_profiler(self.out_dir, cfg.max_steps - self.state.step, cfg.profile_steps, self.device)
                    if cfg.profile else None)
        start, window_t, window_tokens, window_useful = time.perf_counter(), time.perf_counter(), 0, 0
        while self.state.step < cfg.max_steps and not self._should_stop():
            m = self.train_step()
            if profiler is not None:
                profiler.step()
            self.state.step += 1
            self.state.losses.append(m["loss"])
            self.state.tokens_seen += m["tokens"]
            self.state.useful_tokens_seen += m["useful_tokens"]
            self.state.block_sparsity_sum += m["block_sparsity"] or 0.0
            window_tokens, window_useful = window_tokens + m["tokens"], window_useful + m["useful_tokens"]
            if self.state.step % cfg.log_every == 0 or self.state.step == cfg.max_steps:
                dt = time.perf_counter() - window_t
                self._log(m, window_tokens / dt, window_useful / dt)
                window_t, window_tokens, window_useful = time.perf_counter(), 0, 0
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{m['loss']:.3f}")
            if cfg.save_every and self.state.step % cfg.save_every == 0:
                self.save()
        self.wall_s += time.perf_counter() - start
        if profiler is not None:
            profiler.stop()
        if progress is not None:
            progress.close()

    def _log(self, m: dict, tokens_per_s: float, useful_per_s: float) -> None:
        peak_flops = self.job.hardware.peak_tflops * 1e12
        self.metrics.scalars({
            "loss": m["loss"], "lr": self.scheduler.get_last_lr()[0], "grad_norm": m["grad_norm"],
            "tokens_per_s": tokens_per_s, "useful_tokens_per_s": useful_per_s,
            "mfu": useful_per_s * self.flops_per_token / peak_flops,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "useful_token_fraction": m["useful_tokens"] / m["tokens"], "block_sparsity": m["block_sparsity"],
        }, self.state.step)

    def _progress_bar(self):
        if not self.job.train.progress or not self.dist.is_main:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.job.train.max_steps, initial=self.state.step, desc="train", unit="step")

    def _should_stop(self) -> bool:
        if torch.distributed.is_initialized():
            return self._stop_agreed
        return self._stop_signal is not None

    @contextlib.contextmanager
    def _signals_request_stop(self):
        """While training, SIGINT/SIGTERM finish the current step, save and stop; the old handlers come back."""
        def request_stop(signum, frame):
            self._stop_signal = signum

        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread (e.g. under some launchers)
                previous[sig] = signal.signal(sig, request_stop)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # -- results, checkpoints, resume ---------------------------------------------------------------------
    def summary(self) -> dict:
        """The numbers summary.json reports."""
        s = self.state
        wall = max(self.wall_s, 1e-9)
        return {
            "steps": s.step,
            "tokens_seen": s.tokens_seen,
            "useful_tokens_seen": s.useful_tokens_seen,
            "useful_token_fraction": s.useful_tokens_seen / max(1, s.tokens_seen),
            "tokens_per_s": s.tokens_seen / wall,
            "useful_tokens_per_s": s.useful_tokens_seen / wall,
            "mfu": s.useful_tokens_seen / wall * self.flops_per_token / (self.job.hardware.peak_tflops * 1e12),
            "initial_loss": s.losses[0] if s.losses else None,
            "final_loss": s.losses[-1] if s.losses else None,
            "losses": list(s.losses),
            "skipped_nonfinite_steps": s.skipped_nonfinite,
            "block_sparsity": s.block_sparsity_sum / max(1, s.step) if self._patched_attention else None,
            "attention": self.attn.as_dict() if self.attn is not None else None,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "wall_s": self.wall_s,
            "stopped_by_signal": self._stop_signal,
        }

    def _hparams(self) -> dict:
        j = self.job
        return {"model": j.model.name, "attn": j.attn.mode,
                "backend": self.attn.backend.value if self.attn is not None else "hf",
                "memory": j.memory.policy, "seq_len": j.data.seq_len, "packing": j.data.packing,
                "micro_batch": j.train.micro_batch, "grad_accum": j.train.grad_accum, "lr": j.optim.lr}

    def trainer_state(self) -> dict:
        """Everything besides the weights that an exact resume needs."""
        return {
            "train": asdict(self.state), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "data": self.loader.state_dict(), "rng": _rng_state(),
            "wall_s": self.wall_s,
        }

    def save(self) -> Path:
        """Checkpoint to out_dir/checkpoints/step_<N> (every rank calls this; rank 0 writes the weights)."""
        lora = self.job.model.lora
        merge = lora if lora.r > 0 and self.job.train.merge_lora_on_save else None
        return save_checkpoint_all_ranks(self.out_dir / "checkpoints", self.state.step, self.model, self.tokenizer,
                                         self.trainer_state(), merge_lora=merge)

    def resume(self, spec: str) -> Optional[Path]:
        """train.resume: auto (latest under out_dir/checkpoints, if any) or a step_<N> directory."""
        if spec == "auto":
            path = find_latest_checkpoint(self.out_dir / "checkpoints")
            if path is None:
                log.info("train.resume=auto: no checkpoint under %s, starting fresh", self.out_dir / "checkpoints")
                return None
        else:
            path = Path(spec)
            if not (path / "trainer_state.pt").is_file():
                raise UserError(f"train.resume={spec!r} is not a checkpoint directory (no trainer_state.pt in it).")
        state = load_checkpoint_all_ranks(path, self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The saved lr came from the old schedule; re-derive it so a changed train.max_steps applies at once.
        for group, base_lr, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                          self.scheduler.lr_lambdas):
            group["lr"] = base_lr * factor(self.scheduler.last_epoch)
        try:
            self.loader.load_state_dict(state["data"])
        except ValueError as e:
            raise UserError(f"train.resume={spec}: {e}") from None
        _set_rng_state(state["rng"])
        self.state = TrainState(**state["train"])
        self.wall_s = state.get("wall_s", 0.0)
        log.info("resumed from %s at step %d", path, self.state.step)
        return path
