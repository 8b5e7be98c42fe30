"""Per-document SDPA on CPU ("varlen"): a packed token costs what a padded one costs.

The dense reference backend hands SDPA a boolean mask per query chunk; SDPA's CPU flash kernel then visits
every key block of the chunk, masked or not. Here each document is its own causal SDPA call instead (the
kernel's `is_causal` path skips the blocks above the diagonal), like flash-attn's varlen API:

- a batch's layout is read on the host once (the one host sync per micro-batch) into a small plan: one row per
  span of queries, planned by `build_varlen_plan`;
- spans of equal shape run as one batched kernel call (whole-row documents: one call on views, no copy);
- with a sliding window, the first `window` queries of a document are a causal span and the rest are chunks of
  `chunk` queries whose keys start `window - 1` before them: keys outside the window are skipped, not masked
  (a band mask, the same for every chunk, decides inside the `chunk + window - 1` keys a chunk reads).

Forward and backward are one custom op each (`flexengine::varlen_attention[_backward]`), so autograd saves
only q, k, v, the output and its log-sum-exp (what one SDPA call saves), the backward writes each span's
gradient once (no per-span full-size gradient buffers), and torch.compile sees one opaque op whose layout
input is the [B, S] document ids (a new layout is new data, not a recompile). The plan is built once per batch
(`plan_calls`, when the mask is built) and found again by every layer's forward and backward.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

# plan columns: kind, row, q_start, q_len (kind: CAUSAL = a document's causal span, BAND = a windowed chunk)
CAUSAL, BAND = 0, 1
_KIND, _ROW, _START, _LEN = range(4)


def band_chunk(window: int) -> int:
    """Queries per windowed chunk: each chunk reads chunk + window - 1 keys for chunk * window useful pairs, so
    smaller chunks waste less, until the kernel's own blocking stops paying. Measured (S=4096, fwd+bwd, one
    thread): window 256 -> 64 queries best (128: +9 %, 256: +28 %); window 1024 -> 128 best (64: +6 %, 256: +4 %)."""
    return max(64, min(128, window // 8))


def document_runs(document_ids_BS: Tensor) -> list[list[tuple[int, int]]]:
    """(start, length) of every run of equal document ids, per row; reads the ids on the host once."""
    runs: list[list[tuple[int, int]]] = []
    for row in document_ids_BS.cpu():
        lengths = torch.unique_consecutive(row, return_counts=True)[1].tolist()
        runs.append(list(zip(itertools.accumulate(lengths, initial=0), lengths)))
    return runs


def build_varlen_plan(runs: list[list[tuple[int, int]]], window: Optional[int], chunk: Optional[int] = None) -> Tensor:
    """Spans covering every query of every row once: int64 [spans, 4] (kind, row, q_start, q_len), sorted so
    that spans of one kernel call are adjacent. runs: per row, the (start, length) of each document."""
    spans = []
    for b, row in enumerate(runs):
        for start, length in row:
            if window is None or length <= window:
                spans.append((CAUSAL, b, start, length))  # the window never binds inside the document
                continue
            spans.append((CAUSAL, b, start, window))  # a query < window into its document sees it all
            c = chunk or band_chunk(window)
            for q0 in range(start + window, start + length, c):
                spans.append((BAND, b, q0, min(c, start + length - q0)))
    # one kernel call per (kind, q_len); inside it, row-major order keeps whole-row spans adjacent (a view)
    spans.sort(key=lambda s: (s[_KIND], s[_LEN], s[_ROW], s[_START]))
    return torch.tensor(spans, dtype=torch.int64).view(-1, 4)


Calls = list[tuple[int, int, list[tuple[int, int]]]]  # kernel calls: (kind, q_len, [(row, q_start), ...])
_plans: list[tuple[Tensor, int, Calls]] = []  # the last few batches' (document ids, window, calls)
_PLANS_KEPT = 4  # a batch's forward and backward (and a checkpoint's recompute) come back for its plan


def _groups(plan: Tensor) -> Calls:
    """Kernel calls of a plan: (kind, q_len, [(row, q_start), ...])."""
    calls: Calls = []
    for kind, row, start, length in plan.tolist():
        if calls and calls[-1][0] == kind and calls[-1][1] == length:
            calls[-1][2].append((row, start))
        else:
            calls.append((kind, length, [(row, start)]))
    return calls


def plan_calls(document_ids_BS: Tensor, window: int) -> Calls:
    """The kernel calls for a batch's document ids ([B, S], one id per run; window 0 = whole documents),
    planned on the first request and found again by every layer (equal ids, not only the same tensor)."""
    ids_BS = document_ids_BS.cpu()  # the one host read of the batch (free on CPU)
    for ids, w, calls in _plans:
        if w == window and ids.shape == ids_BS.shape and torch.equal(ids, ids_BS):
            return calls
    calls = _groups(build_varlen_plan(document_runs(ids_BS), window or None))
    _plans.insert(0, (ids_BS.clone(), window, calls))  # a copy: the caller may reuse its buffer
    del _plans[_PLANS_KEPT:]
    return calls


def _consecutive(where: list[tuple[int, int]]) -> bool:
    """Spans on consecutive rows at one offset (e.g. whole-row documents): one slice of the batch."""
    r0, s0 = where[0]
    return all(r == r0 + i and s == s0 for i, (r, s) in enumerate(where))


def _gather(x_BHSD: Tensor, where: list[tuple[int, int]], width: int) -> Tensor:
    """[n, H, width, D]: for each (row, start), x[row, :, start : start + width]; a view when the spans are
    consecutive rows at one offset, else a (transient) copy."""
    if _consecutive(where):
        r0, s0 = where[0]
        return x_BHSD[r0 : r0 + len(where), :, s0 : s0 + width]
    return torch.stack([x_BHSD[r, :, s : s + width] for r, s in where])


def _put(dst_BHSD: Tensor, src: Tensor, where: list[tuple[int, int]], width: int, accumulate: bool) -> None:
    """Write (or add) src [n, H, width, D] back to where `_gather` read it."""
    if _consecutive(where):
        r0, s0 = where[0]
        views = [dst_BHSD[r0 : r0 + len(where), :, s0 : s0 + width]]
        parts: Iterable[Tensor] = [src]  # one view takes all of src
    else:
        views = [dst_BHSD[r, :, s : s + width] for r, s in where]
        parts = src  # span i gets src[i]
    for view, part in zip(views, parts):
        view.add_(part) if accumulate else view.copy_(part)


def _whole_batch(calls: list, shape: torch.Size) -> bool:
    """The plan is one call over every row from 0 to S (every row a single document, no window)."""
    B, _, S, _ = shape
    return len(calls) == 1 and calls[0][0] == CAUSAL and calls[0][1] == S and calls[0][2] == [(r, 0) for r in range(B)]


def _like(x: Tensor, ref: Tensor) -> Tensor:
    """x with ref's strides (what the op's fake implementation promises torch.compile)."""
    return x if x.stride() == ref.stride() else torch.empty_like(ref).copy_(x)


_band_masks: dict = {}


def _band_mask(q_len: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask [q_len, q_len + window - 1] of a windowed chunk whose keys start window - 1 before its
    first query: query i sees keys i .. i + window - 1 (itself and the window - 1 before it)."""
    key = (q_len, window, dtype, device)
    if key not in _band_masks:
        i = torch.arange(q_len, device=device)[:, None]
        j = torch.arange(q_len + window - 1, device=device)[None, :]
        allowed = (j >= i) & (j <= i + window - 1)
        _band_masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
    return _band_masks[key]


def _call_shapes(kind: int, q_len: int, window: int) -> tuple[int, int, bool]:
    """(key offset from the first query, key count, is_causal) of one kernel call."""
    if kind == CAUSAL:
        return 0, q_len, True
    return -(window - 1), q_len + window - 1, False


@torch.library.custom_op("flexengine::varlen_attention", mutates_args=(), device_types="cpu")
def _varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor, window: int, scale: Optional[float]
) -> tuple[Tensor, Tensor]:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> (out [B, S, Hq, D], logsumexp [B, S, Hq])."""
    B, H, S, D = q.shape
    calls = plan_calls(document_ids, window)
    if _whole_batch(calls, q.shape):  # the padded path's single call: no copy in or out
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return o.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()
    out = q.new_empty(B, S, H, D)
    lse = q.new_empty(B, S, H, dtype=torch.float32)
    out_BHSD, lse_BHS1 = out.transpose(1, 2), lse.transpose(1, 2)[..., None]
    for kind, q_len, where in calls:
        k_off, k_len, causal = _call_shapes(kind, q_len, window)
        mask = None if causal else _band_mask(q_len, window, q.dtype, q.device)
        k_where = _shift(where, k_off)
        o, o_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _gather(q, where, q_len),
            _gather(k, k_where, k_len),
            _gather(v, k_where, k_len),
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        _put(out_BHSD, o, where, q_len, accumulate=False)
        _put(lse_BHS1, o_lse[..., None], where, q_len, accumulate=False)
    return out, lse


def varlen_attention_op() -> Any:
    """The forward custom op as dispatch modes see it (op-level SAC keeps its outputs)."""
    return torch.ops.flexengine.varlen_attention.default


@_varlen_forward.register_fake
def _(q, k, v, document_ids, window, scale):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D), q.new_empty(B, S, H, dtype=torch.float32)


def _shift(where: list[tuple[int, int]], offset: int) -> list[tuple[int, int]]:
    return where if offset == 0 else [(r, s + offset) for r, s in where]


@torch.library.custom_op("flexengine::varlen_attention_backward", mutates_args=(), device_types="cpu")
def _varlen_backward(
    grad_out: Tensor, saved: list[Tensor], window: int, scale: Optional[float]
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of `_varlen_forward` for q, k, v (saved: q, k, v, out, lse, document_ids); each span's share is
    written once (added where windowed chunks read overlapping keys)."""
    q, k, v, out, lse, document_ids = saved
    grad_BHSD, out_BHSD, lse_BHS1 = grad_out.transpose(1, 2), out.transpose(1, 2), lse.transpose(1, 2)[..., None]
    calls = plan_calls(document_ids, window)
    if _whole_batch(calls, q.shape):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_BHSD, q, k, v, out_BHSD, lse_BHS1[..., 0], 0.0, True, scale=scale
        )
        return _like(grads[0], q), _like(grads[1], k), _like(grads[2], v)
    overlap = any(kind == BAND for kind, _, _ in calls)  # windowed chunks share keys: accumulate
    dq = torch.empty_like(q)  # the spans partition the queries: every element is written once
    dk, dv = (torch.zeros_like(k), torch.zeros_like(v)) if overlap else (torch.empty_like(k), torch.empty_like(v))
    for kind, q_len, where in calls:
        k_off, k_len, causal = _call_shapes(kind, q_len, window)
        mask = None if causal else _band_mask(q_len, window, q.dtype, q.device)
        k_where = _shift(where, k_off)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _gather(grad_BHSD, where, q_len),
            _gather(q, where, q_len),
            _gather(k, k_where, k_len),
            _gather(v, k_where, k_len),
            _gather(out_BHSD, where, q_len),
            _gather(lse_BHS1, where, q_len)[..., 0],
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        _put(dq, gq, where, q_len, accumulate=False)
        _put(dk, gk, k_where, k_len, accumulate=overlap)
        _put(dv, gv, k_where, k_len, accumulate=overlap)
    return dq, dk, dv


@_varlen_backward.register_fake
def _(grad_out, saved, window, scale):
    q, k, v = saved[:3]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, document_ids, window, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, document_ids)
    ctx.window, ctx.scale = window, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out: Tensor, grad_lse: Optional[Tensor]):
    dq, dk, dv = _varlen_backward(grad_out, list(ctx.saved_tensors), ctx.window, ctx.scale)
    return dq, dk, dv, None, None, None


_varlen_forward.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(
    q_BHSD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    document_ids_BS: Tensor,
    window: Optional[int],
    scale: Optional[float],
) -> Tensor:
    """Per-document attention: q [B, Hq, S, D], k/v [B, Hkv, S, D], document ids [B, S] (runs of equal ids are
    documents) -> out [B, S, Hq, D]. window: keys at most window - 1 before the query (None = whole document)."""
    if torch.is_autocast_enabled(q_BHSD.device.type):
        # a custom op gets no autocast rule: compute in the autocast dtype, as SDPA (the dense backend) does under
        # autocast; HF's rotary embedding hands over fp32 q/k next to a bf16 v, which the CPU kernel refuses
        dtype = torch.get_autocast_dtype(q_BHSD.device.type)
        q_BHSD, k_BHSD, v_BHSD = (t.to(dtype) for t in (q_BHSD, k_BHSD, v_BHSD))
    out, _ = _varlen_forward(q_BHSD, k_BHSD, v_BHSD, document_ids_BS, window or 0, scale)
    return out
