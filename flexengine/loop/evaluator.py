"""Held-out evaluations and greedy samples between training steps.

`Evaluator` is the trainer's component for them: when one is due, running it (a stop signal cuts either short
within one batch or token), the best step and early stopping, and their timings. It holds, from its construction
(loop/components.py), the forward path, the run's shared counters (TrainState), the clock, the metrics writer, the
stop signals and the Checkpointer that keeps the best step. The functions below it are the library calls it runs,
usable alone.

The eval loss is computed exactly like the training loss (same packed rows, masks and chunked CE through the
same forward module), summed over every valid target of the held-out set on all ranks and divided once:
sum(token CE) / valid targets, so it does not depend on how rows fall into batches or ranks.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Optional, Sequence

import torch
from torch import nn

from flexengine.core.config import DataConfig, TrainConfig
from flexengine.core.errors import UserError
from flexengine.data.build import pad_token_id
from flexengine.data.encode import document_separator
from flexengine.data.loader import HeldOut
from flexengine.data.targets import batch_valid_targets
from flexengine.loop.checkpointer import Checkpointer
from flexengine.loop.forward import ForwardPath
from flexengine.loop.metrics import MetricsWriter
from flexengine.loop.progress import Progress
from flexengine.loop.signals import StopSignals
from flexengine.loop.state import TrainState

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

EVAL_LOG_EVERY_S = 15.0  # a progress line this often during one evaluation
EVAL_BUDGET = 0.10  # warn when one evaluation costs more than this fraction of the training between two


class Evaluator:
    """Evaluations of the held-out set (none without one) and greedy samples of train.sample_prompts, between steps.
    Owns what they leave: their timings, the last sampled step, early stopping, and whether a signal cut one short;
    records each evaluation in the shared TrainState (history, best step, patience)."""

    def __init__(
        self,
        held_out: Optional[HeldOut],
        train: TrainConfig,
        *,
        forward: ForwardPath,
        tokenizer: Optional[PreTrainedTokenizerBase],
        state: TrainState,
        progress: Progress,
        metrics: MetricsWriter,
        signals: StopSignals,
        checkpointer: Checkpointer,
        block_size: int,
        is_main: bool = True,
        data: DataConfig,
    ) -> None:
        if train.sample_prompts and tokenizer is None:  # refused now, not at the run's end before its final save
            raise UserError(
                "train.sample_prompts: sampling needs the run's tokenizer (this Trainer was built without one); "
                "pass the tokenizer or set train.sample_prompts=[]"
            )
        self.held_out, self.train, self.is_main = held_out, train, is_main
        self.forward, self.tokenizer, self.state, self.progress = forward, tokenizer, state, progress
        self.metrics, self.signals, self.checkpointer = metrics, signals, checkpointer
        self.block_size = block_size  # attn.block_size: sampled rows are padded to whole blocks per cp rank
        # a chat run (every source holds conversations only: data.format=chat) samples its prompts as user turns
        # through the chat template, the form it trains on; a sample ends at the tokenizer's eos or, for text data,
        # at the document separator
        self.chat_prompts = all(f.chats and not f.texts for f in data.format_specs)
        self.end_ids = sample_end_ids(tokenizer, data) if tokenizer is not None else frozenset()
        self.eval_seconds: list[float] = []  # each evaluation's forward passes in this process (ETA, eval budget)
        self.last_sample_step = -1
        self.stopped_early = False  # train.early_stop_patience ran out
        self.cut_short = False  # a stop signal ended an evaluation or a sampling early (the run ends interrupted)

    # -- when ---------------------------------------------------------------------------------------------------
    def should_evaluate(self, step: int) -> bool:
        """Inside the loop: every train.eval_every steps, with a held-out set."""
        every = self.train.eval_every
        return self.held_out is not None and bool(every) and step % every == 0

    def due_at_end(self, step: int) -> bool:
        """The end of the run is always evaluated (unless that step already was)."""
        return self.held_out is not None and not any(e["step"] == step for e in self.state.evals)

    def should_sample(self, step: int) -> bool:
        """Inside the loop: every train.sample_every steps, else with every evaluation; never after a cut."""
        if not self.train.sample_prompts or self.cut_short:
            return False
        if self.train.sample_every:
            return step % self.train.sample_every == 0
        evals = self.state.evals
        return bool(evals) and evals[-1]["step"] == step

    def samples_at_end(self, step: int) -> bool:
        """The end of the run is sampled too (unless that step already was, or a signal cut something short)."""
        return bool(self.train.sample_prompts) and not self.cut_short and self.last_sample_step != step

    def seconds_left(self, step: int, step_s: float) -> float:
        """The evaluations still due after `step` at the mean time of one so far (before the first: a forward-only
        guess, a third of a micro-batch step of `step_s`)."""
        if self.held_out is None:
            return 0.0
        cfg = self.train
        every = cfg.eval_every
        # the step line is logged before its step's evaluation, so an evaluation at this very step is still due
        in_loop = cfg.max_steps // every - (max(step, 1) - 1) // every if every else 0
        final = not every or cfg.max_steps % every > 0  # the end of the run is always evaluated
        if self.eval_seconds:
            one = sum(self.eval_seconds) / len(self.eval_seconds)
        else:
            one = self.held_out.num_batches * step_s / cfg.grad_accum / 3
        return (in_loop + final) * one

    # -- running them -----------------------------------------------------------------------------------------------
    def evaluate(self) -> Optional[dict[str, Any]]:
        """Eval loss/perplexity on the held-out set at the current step; marks (and saves) a new best, counts
        early-stop patience. None without a held-out set, or when a stop signal cut it short (within one batch)."""
        if self.held_out is None:
            return None
        start = time.perf_counter()
        step = self.state.step
        step_s = self.progress.mean_step_s(step)  # the training before this evaluation
        fwd = self.forward
        fwd.model.eval()
        with self.signals.pausing("evaluation"):
            result = evaluate_loss(
                fwd.train_module,
                self.held_out.batches(),
                fwd.device,
                fwd.prepare,
                fwd.compute_context,
                stop=self.signals.requested,
                on_batch=EvalProgress(step, self.held_out.num_batches, enabled=self.is_main),
            )
        fwd.model.train()
        if result is None:  # a stop signal: no eval record (a partial set is no loss to compare), on to the save
            self._cut("evaluation", start)
            return None
        self.eval_seconds.append(time.perf_counter() - start)
        self._check_budget(self.held_out.num_batches, self.progress.steps_run(step), step, step_s)
        record = self._record(result)
        self.progress.pause(time.perf_counter() - start)
        return record

    def _record(self, result: dict[str, Any]) -> dict[str, Any]:
        """Keep an evaluation's result: the history, TensorBoard, the best step (and its checkpoint), patience."""
        s = self.state
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
        if improved:
            self.checkpointer.keep_best()
        patience = self.train.early_stop_patience
        if patience and s.evals_since_best >= patience:
            self.stopped_early = True
            log.warning(
                "early stop at step %d: no better eval loss in %d evaluations (best %.4f at step %d)",
                s.step,
                s.evals_since_best,
                s.best_eval_loss,
                s.best_step,
            )
        return record

    def _check_budget(self, batches: int, done: int, step: int, step_s: float) -> None:
        """After the first in-loop evaluation: warn when one costs more than ~10 % of the training between two, and
        say which train.eval_batches would fit."""
        cfg = self.train
        if len(self.eval_seconds) != 1 or not cfg.eval_every or not done or step >= cfg.max_steps:
            return
        warning = eval_budget_warning(self.eval_seconds[-1], batches, cfg.eval_every, step_s, cfg.eval_batches)
        if warning and self.is_main:
            log.warning("eval: %s", warning)

    def sample(self) -> Optional[list[str]]:
        """Greedy continuations of train.sample_prompts, written to TensorBoard text (samples/<i>); None when a
        stop signal cut it short (within one generated token)."""
        if self.tokenizer is None:
            raise UserError(
                "train.sample_prompts: sampling needs the run's tokenizer (this Trainer was built without one)"
            )
        tokenizer = self.tokenizer
        start = time.perf_counter()
        cfg, fwd = self.train, self.forward
        cp = fwd.context_parallel

        def logits_of(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            # through the root module (FSDP2/DDP hooks run there): every rank calls it with the same row
            batch = {"input_ids": input_ids, "position_ids": position_ids}
            if cp is not None:  # the row split over the cp ranks, the logits put together
                return cp.logits(fwd.train_module, fwd.model, batch)
            return fwd.train_module(batch, logits=True)

        fwd.model.eval()
        with fwd.compute_context(), self.signals.pausing("sampling"):
            # rows in whole blocks per cp rank (the context-parallel split needs cp x block_size)
            texts = greedy_continue(
                logits_of,
                tokenizer,
                cfg.sample_prompts,
                cfg.sample_tokens,
                fwd.device,
                pad_to=self.block_size * fwd.cp,
                stop=self.signals.requested,
                chat=self.chat_prompts,
                end_ids=self.end_ids,
            )
        fwd.model.train()
        if texts is None:
            self._cut("sampling", start)
            return None
        step = self.state.step
        for i, (prompt, text) in enumerate(zip(cfg.sample_prompts, texts)):
            self.metrics.text(f"samples/{i}", f"**{prompt}**{text}", step)
            self.metrics.record({"type": "sample", "step": step, "prompt": prompt, "text": text})
        self.last_sample_step = step
        self.progress.pause(time.perf_counter() - start)
        return texts

    def _cut(self, activity: str, start: float) -> None:
        """An evaluation or sampling a signal stopped: the run ends as interrupted (saved, 128 + signal), so a
        requeue with train.resume=auto does what is left."""
        self.cut_short = True
        self.progress.pause(time.perf_counter() - start)
        log.warning("signal: %s at step %d stopped; saving and exiting", activity, self.state.step)

    # -- what is reported at the end --------------------------------------------------------------------------------
    def summary(self) -> Optional[dict[str, Any]]:
        """The held-out results: the last evaluation, the best one and its checkpoint, the history (None: none
        ran)."""
        s = self.state
        if not s.evals:
            return None
        best = self.checkpointer.best_checkpoint()
        return {
            "loss": s.evals[-1]["loss"],
            "ppl": s.evals[-1]["ppl"],
            "best_loss": s.best_eval_loss,
            "best_step": s.best_step,
            "best_checkpoint": str(best) if best is not None else None,
            "history": list(s.evals),
        }


@torch.no_grad()
def evaluate_loss(
    forward: nn.Module,
    batches: Iterable[dict],
    device: torch.device,
    prepare: Callable[[dict], tuple[dict, dict]],
    autocast: Callable,
    *,
    stop: Optional[Callable[[], bool]] = None,
    on_batch: Optional[Callable[[int], None]] = None,
) -> Optional[dict]:
    """{"loss", "ppl", "tokens"} over the batches (every rank passes its own share; the sums are all-reduced).
    prepare: batch -> (what this rank computes of it, its mask kwargs), as in training (ForwardPath.prepare).
    stop: asked before each batch (the same answer on every rank); True ends the evaluation there: None, since
    a part of the held-out set is no eval loss to compare or keep (a stop signal must not wait for hours of eval).
    on_batch: called with the number of batches done after each one (progress lines)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [summed token CE, valid targets]
    for done, batch in enumerate(batches, 1):
        if stop is not None and stop():
            return None
        # tensors only: the loader's host-side facts (useful_tokens, document_lengths) stay on the host
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        batch, mask_kwargs = prepare(batch)
        with autocast():
            loss_sum = forward(batch, **mask_kwargs)
        sums += torch.stack([loss_sum.double(), batch_valid_targets(batch).double()])
        if on_batch is not None:
            on_batch(done)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    total, tokens = sums.tolist()
    loss = total / tokens if tokens else float("nan")
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": int(tokens)}


class EvalProgress:
    """on_batch callback: a line when an evaluation starts and then every `every_s` seconds (batches done of the
    total, elapsed, estimated left), so a long evaluation is never silent."""

    def __init__(self, step: int, total: int, enabled: bool = True, every_s: float = EVAL_LOG_EVERY_S) -> None:
        self.step, self.total, self.enabled, self.every_s = step, total, enabled, every_s
        self.start = self.last = time.perf_counter()
        if enabled:
            log.info("eval step %d: %d batches", step, total)

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < self.every_s or done >= self.total:
            return
        self.last = now
        elapsed = now - self.start
        log.info(
            "eval step %d: batch %d/%d, %.0f s elapsed, ~%.0f s left",
            self.step,
            done,
            self.total,
            elapsed,
            elapsed / done * (self.total - done),
        )


def eval_budget_warning(
    eval_s: float, batches: int, eval_every: int, step_s: float, eval_batches: int
) -> Optional[str]:
    """Why one evaluation of eval_s seconds (over `batches` micro-batches) is too dear for a run training step_s
    seconds per step and evaluating every eval_every steps (None if it costs at most EVAL_BUDGET of that), with
    the train.eval_batches that would fit."""
    between = eval_every * step_s
    if between <= 0 or eval_s <= EVAL_BUDGET * between:
        return None
    fitting = max(1, int(EVAL_BUDGET * between / (eval_s / max(1, batches))))
    whole = "the whole held-out set, " if eval_batches == 0 else ""
    return (
        f"one evaluation ({whole}{batches} batches) took {eval_s:.1f} s, {eval_s / between:.0%} of the "
        f"{between:.1f} s of training between evaluations (train.eval_every={eval_every}): set "
        f"train.eval_batches={fitting} (about {EVAL_BUDGET:.0%}; the same batches each time) or raise train.eval_every."
    )


def _padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@torch.no_grad()
def sample_end_ids(tokenizer: PreTrainedTokenizerBase, data: Optional[DataConfig]) -> frozenset[int]:
    """The tokens a sample ends at: the tokenizer's eos, and for text data the token the run ends its documents
    with (data.separator; an instruct tokenizer's eos is its end-of-turn, not the end-of-text the run trains)."""
    ends = {tokenizer.eos_token_id}
    if data is not None and data.add_eos and any(f.texts for f in data.format_specs):
        ends.add(document_separator(tokenizer, data.separator).id)
    return frozenset(e for e in ends if e is not None)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool) -> list[int]:
    """A sample prompt's token ids: as text, or (chat) as one user turn rendered by the chat template with the
    assistant's generation prompt after it, so the model continues as the assistant it is trained to be."""
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str)  # tokenize=False renders one conversation to one string
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template wrote its own BOS, if any


def greedy_continue(
    logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    new_tokens: int,
    device: torch.device,
    *,
    pad_to: int = 128,
    stop: Optional[Callable[[], bool]] = None,
    chat: bool = False,
    end_ids: Optional[Collection[int]] = None,
) -> Optional[list[str]]:
    """Each prompt continued greedily by `new_tokens` tokens (stops at one of end_ids, default the EOS); returns the
    continuations, or None when `stop()` (asked before each token, the same answer on every rank) said to stop.
    chat: each prompt is a user turn through the chat template (prompt_ids).

    logits_of(input_ids, position_ids) -> [1, width, vocab]. No KV cache: each token re-runs the prompt so far,
    right-padded to one width for the whole call (the longest prompt plus `new_tokens`, rounded up to `pad_to`;
    causal attention: padding after a position never changes its logits). So a compiled model, and torch's
    compiled CP mask builder (which compiles a variant per shape, up to dynamo's recompile limit, then fails
    the run), see one new shape per call, the same at every call, rather than one per prompt or per token.
    Under torchrun every rank runs this in lockstep (sharded weights are gathered per forward) and takes rank
    0's token, so a tie broken differently on another rank can never make the ranks run different numbers of
    forwards.
    """
    distributed = torch.distributed.is_initialized()
    pad_id = pad_token_id(tokenizer)
    rows = [prompt_ids(tokenizer, prompt, chat) for prompt in prompts]
    ends = {tokenizer.eos_token_id} if end_ids is None else set(end_ids)
    width = _padded_length(max(map(len, rows), default=0) + new_tokens, pad_to)
    outputs: list[str] = []
    for ids in rows:
        start = len(ids)
        for _ in range(new_tokens):
            if stop is not None and stop():
                return None
            row = torch.full((1, width), pad_id, dtype=torch.long, device=device)
            row[0, : len(ids)] = torch.tensor(ids, device=device)
            positions = torch.arange(width, device=device)[None]
            token = logits_of(row, positions)[0, len(ids) - 1].argmax()
            if distributed:
                torch.distributed.broadcast(token, src=0)
            ids.append(int(token))
            if ids[-1] in ends:
                break
        text = tokenizer.decode(ids[start:], skip_special_tokens=False)
        assert isinstance(text, str)  # one flat list of ids decodes to one string (a batch would give a list)
        outputs.append(text)
    return outputs
