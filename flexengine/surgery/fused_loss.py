"""Fused linear cross-entropy: lm_head + CE in chunks whose gradients are computed in the forward.

The chunked loss (surgery/loss.py) checkpoints each chunk, so backward runs lm_head's forward again (2 x hidden x
vocab FLOPs per predicting position). Here each chunk's logits, CE sum, gradient w.r.t. its hidden rows and
contribution to lm_head's weight and bias gradients are computed once, in the forward; backward only scales the
saved gradients by the incoming one. What the forward holds for backward instead of the chunks' inputs: the
hidden rows' gradient [N, H] and, where lm_head trains, its weight (and bias) gradient [V, H].

Numerics follow the chunked path: the matmuls run in autocast's dtype when autocast is on (else the weight's), the
logits are cast to fp32 for the softmax, and the logits' gradient is cast back to the matmuls' dtype. The weight
gradient is summed over chunks in the weight's own dtype (fp32 masters under autocast: more exact than
autograd's sum of bf16 chunk gradients). A tied lm_head (the input embedding's weight) is a plain input of the
function: autograd adds this gradient to the embedding's.

Legend: N predicting positions, H hidden, V vocabulary, C rows of one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from flexengine.core.errors import UserError


def check_fusable_head(lm_head: nn.Module) -> nn.Linear:
    """lm_head as the plain nn.Linear the fused loss reads its weight and bias from, or a UserError naming
    loss.fused (a wrapped head, e.g. a LoRA adapter on lm_head, runs its own forward: the fused loss would skip it)."""
    if type(lm_head) is not nn.Linear:
        raise UserError(
            f"loss.fused=true needs lm_head to be a plain torch.nn.Linear, got {type(lm_head).__module__}."
            f"{type(lm_head).__name__} (a wrapper's own forward would be skipped): set loss.fused=false "
            "(the chunked loss calls lm_head itself), or leave lm_head out of model.lora.target_modules."
        )
    return lm_head


def fused_linear_cross_entropy_sum(hidden_NH: Tensor, targets_N: Tensor, lm_head: nn.Linear, chunk_size: int) -> Tensor:
    """Sum over rows of CE(hidden_NH @ W^T + b, targets_N) in chunks of chunk_size rows (every target valid),
    with the gradients computed chunk by chunk in this call (module docstring)."""
    weight, bias = lm_head.weight, lm_head.bias
    grads = torch.is_grad_enabled()
    needs = (
        grads and hidden_NH.requires_grad,
        grads and weight.requires_grad,
        grads and bias is not None and bias.requires_grad,
    )
    device_type = hidden_NH.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    return _FusedLinearCrossEntropy.apply(hidden_NH, targets_N, weight, bias, _Chunking(chunk_size, dtype, needs))


@dataclass(frozen=True)
class _Chunking:
    """How the fused forward runs: rows per chunk, the matmuls' dtype, and which gradients it computes."""

    chunk_size: int
    dtype: torch.dtype  # autocast's dtype where autocast is on, else the weight's
    needs: tuple[bool, bool, bool]  # gradients w.r.t. (hidden, weight, bias)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: Tensor,
        targets_N: Tensor,
        weight_VH: Tensor,
        bias_V: Optional[Tensor],
        chunking: _Chunking,
    ) -> Tensor:
        with torch.autocast(hidden_NH.device.type, enabled=False):  # the casts are explicit below
            total, grads = _forward_chunks(hidden_NH, targets_N, weight_VH, bias_V, chunking)
        ctx.save_for_backward(*grads)  # None where not needed: saved_tensors gives it back in its slot
        ctx.spent = False
        return total

    @staticmethod
    @once_differentiable  # the saved gradients are scaled in place: a graph of that (create_graph) would be wrong
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Optional[Tensor], ...]:
        if ctx.spent:  # the saved gradients were scaled in place by the first backward
            raise RuntimeError(
                "the fused loss (loss.fused=true) supports one backward per forward; retain_graph reuse "
                "needs loss.fused=false"
            )
        ctx.spent = True
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        # in place: a second copy of lm_head's [V, H] gradient would be the largest tensor of backward
        scaled = [None if g is None else g.mul_(grad_total.to(g.dtype)) for g in (grad_hidden, grad_weight, grad_bias)]
        return scaled[0], None, scaled[1], scaled[2], None


def _forward_chunks(
    hidden_NH: Tensor,
    targets_N: Tensor,
    weight_VH: Tensor,
    bias_V: Optional[Tensor],
    chunking: _Chunking,
) -> tuple[Tensor, tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]]:
    """(the CE sum, its gradients w.r.t. hidden, weight and bias where `chunking.needs` says), chunk by chunk."""
    n, dtype, needs = hidden_NH.shape[0], chunking.dtype, chunking.needs
    step = chunking.chunk_size if chunking.chunk_size > 0 else max(1, n)
    w_VH = weight_VH.to(dtype)  # autocast's cast, made once for all chunks (a no-op without autocast)
    b_V = bias_V.to(dtype) if bias_V is not None else None
    grad_hidden = torch.empty_like(hidden_NH) if needs[0] else None
    grad_weight = torch.zeros_like(weight_VH) if needs[1] else None
    grad_bias = torch.zeros_like(bias_V) if needs[2] and bias_V is not None else None
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        grad_rows = grad_hidden[rows] if grad_hidden is not None else None
        grads = {"grad_hidden_CH": grad_rows, "grad_weight_VH": grad_weight, "grad_bias_V": grad_bias}
        total = total + _chunk_(hidden_NH[rows], targets_N[rows], w_VH, b_V, **grads)
    return total, (grad_hidden, grad_weight, grad_bias)


def _chunk_(
    hidden_CH: Tensor,
    targets_C: Tensor,
    w_VH: Tensor,
    b_V: Optional[Tensor],
    *,
    grad_hidden_CH: Optional[Tensor],
    grad_weight_VH: Optional[Tensor],
    grad_bias_V: Optional[Tensor],
) -> Tensor:
    """One chunk's CE sum; its gradients written into grad_hidden_CH and added to grad_weight_VH, grad_bias_V
    (those given). Its own function so that the chunk's [C, V] buffers are freed before the next chunk's exist."""
    h_CH = hidden_CH.to(w_VH.dtype)
    logits_CV = F.linear(h_CH, w_VH, b_V).float()  # CE in fp32 even under bf16
    total = _ce_sum_and_grad_(logits_CV, targets_C)
    if grad_hidden_CH is None and grad_weight_VH is None and grad_bias_V is None:
        return total
    grad_CV = logits_CV.to(w_VH.dtype)  # logits_CV now holds d(sum CE)/d(logits)
    del logits_CV  # under bf16: the fp32 buffer goes before the products below
    if grad_hidden_CH is not None:
        grad_hidden_CH.copy_(grad_CV @ w_VH)
    if grad_weight_VH is not None:
        _accumulate_(grad_weight_VH, grad_CV.t(), h_CH)
    if grad_bias_V is not None:
        grad_bias_V += grad_CV.sum(0).to(grad_bias_V.dtype)
    return total


def _ce_sum_and_grad_(logits_CV: Tensor, targets_C: Tensor) -> Tensor:
    """Sum of the rows' CE; logits_CV is overwritten with the sum's gradient, softmax - one_hot(targets)."""
    target_logits_C = logits_CV.gather(1, targets_C.unsqueeze(1)).squeeze(1)
    max_C = logits_CV.amax(dim=-1)
    # in place, not torch.logsumexp: one [C, V] fp32 buffer serves the logits, their exponentials and the gradient
    exp_sum_C = logits_CV.sub_(max_C.unsqueeze(1)).exp_().sum(dim=-1)
    total = (max_C + exp_sum_C.log() - target_logits_C).sum()
    logits_CV.div_(exp_sum_C.unsqueeze(1))
    logits_CV.scatter_add_(1, targets_C.unsqueeze(1), logits_CV.new_full((targets_C.shape[0], 1), -1.0))
    return total


def vocab_slice_rows(chunk_rows: int) -> int:
    """Vocabulary rows per product when lm_head's weight gradient is summed in another dtype than the matmuls':
    each product [rows, H] lives only until it is added, so it stays the size of a chunk's hidden rows."""
    return max(chunk_rows, MIN_VOCAB_SLICE)


MIN_VOCAB_SLICE = 256  # vocabulary rows per product at least: fewer would be many small matmuls per chunk


def _accumulate_(grad_VH: Tensor, grad_VC: Tensor, h_CH: Tensor) -> None:
    """grad_VH += grad_VC @ h_CH: in place where the dtypes agree, else slice by slice of the vocabulary, so the
    compute-dtype product is never [V, H] (under autocast that would be a second lm_head-sized tensor)."""
    if grad_VH.dtype == h_CH.dtype:
        torch.addmm(grad_VH, grad_VC, h_CH, out=grad_VH)  # addmm_'s own form (FLOP counters see this one)
        return
    step = vocab_slice_rows(h_CH.shape[0])
    for start in range(0, grad_VH.shape[0], step):
        grad_VH[start : start + step] += grad_VC[start : start + step] @ h_CH
