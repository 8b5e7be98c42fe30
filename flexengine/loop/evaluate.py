"""Held-out evaluation and greedy samples, run by the trainer between steps.

The eval loss is computed exactly like the training loss (same packed rows, masks and chunked CE through the
same forward module), summed over every valid target of the held-out set on all ranks and divided once:
sum(token CE) / valid targets, so it does not depend on how rows fall into batches or ranks.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from flexengine.data.targets import batch_valid_targets

log = logging.getLogger(__name__)

EVAL_LOG_EVERY_S = 15.0  # a progress line this often during one evaluation
EVAL_BUDGET = 0.10  # warn when one evaluation costs more than this fraction of the training between two


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
    prepare: batch -> (what this rank computes of it, its mask kwargs), as in training (Trainer._prepare).
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

    def __init__(self, step: int, total: int, enabled: bool = True, every_s: Optional[float] = None):
        self.step, self.total, self.enabled = step, total, enabled
        self.every_s = EVAL_LOG_EVERY_S if every_s is None else every_s
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
def greedy_continue(
    logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokenizer,
    prompts: Sequence[str],
    new_tokens: int,
    device: torch.device,
    *,
    pad_to: int = 128,
    stop: Optional[Callable[[], bool]] = None,
) -> Optional[list[str]]:
    """Each prompt continued greedily by `new_tokens` tokens (stops at EOS); returns the continuations, or None
    when `stop()` (asked before each token, the same answer on every rank) said to stop.

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
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    prompt_ids = [list(tokenizer(prompt)["input_ids"]) for prompt in prompts]
    width = _padded_length(max(map(len, prompt_ids), default=0) + new_tokens, pad_to)
    outputs = []
    for ids in prompt_ids:
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
            if ids[-1] == tokenizer.eos_token_id:
                break
        outputs.append(tokenizer.decode(ids[start:], skip_special_tokens=False))
    return outputs
