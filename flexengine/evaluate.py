"""Held-out evaluation and greedy samples, run by the trainer between steps.

The eval loss is computed exactly like the training loss (same packed rows, masks and chunked CE through the
same forward module), summed over every valid target of the held-out set on all ranks and divided once:
sum(token CE) / valid targets, so it does not depend on how rows fall into batches or ranks.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from flexengine.loss import batch_valid_targets


@torch.no_grad()
def evaluate_loss(
    forward: nn.Module,
    batches: Iterable[dict],
    device: torch.device,
    prepare: Callable[[dict], tuple[dict, dict]],
    autocast: Callable,
    stop: Optional[Callable[[], bool]] = None,
) -> Optional[dict]:
    """{"loss", "ppl", "tokens"} over the batches (every rank passes its own share; the sums are all-reduced).
    prepare: batch -> (what this rank computes of it, its mask kwargs), as in training (Trainer._prepare).
    stop: asked before each batch (the same answer on every rank); True ends the evaluation there: None, since
    a part of the held-out set is no eval loss to compare or keep (a stop signal must not wait for hours of eval)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [summed token CE, valid targets]
    for batch in batches:
        if stop is not None and stop():
            return None
        # tensors only: the loader's host-side facts (useful_tokens, document_lengths) stay on the host
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        batch, mask_kwargs = prepare(batch)
        with autocast():
            loss_sum = forward(batch, **mask_kwargs)
        sums += torch.stack([loss_sum.double(), batch_valid_targets(batch).double()])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    total, tokens = sums.tolist()
    loss = total / tokens if tokens else float("nan")
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": int(tokens)}


def _padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@torch.no_grad()
def greedy_continue(
    logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokenizer,
    prompts: Sequence[str],
    new_tokens: int,
    device: torch.device,
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
