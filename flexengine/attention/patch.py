"""Rewrite a loaded HF causal LM's attention through transformers' own registry (no forked modelling code).

`patch_attention` registers one attention function under the name "flexengine" and a forward pre-hook on the
model. The hook builds the batch's mask once from `position_ids` (or `document_ids`) and hands it to every
layer as a keyword argument; transformers forwards extra model kwargs unchanged to the attention function.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface

from flexengine.attention.block_mask import BatchMask, build_batch_mask
from flexengine.attention.masks import document_ids_from_position_ids, position_ids_from_document_ids
from flexengine.config import ATTN_BACKENDS, ATTN_MODES

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "flexengine"
MASK_KWARG = "flexengine_mask"

_compiled_flex = None


def _flex_fn(compile: bool):
    """flex_attention compiled once per process (not per layer); packed rows have a fixed shape, so new
    document layouts reuse the graph. Uncompiled flex materialises the scores: correct but slow."""
    global _compiled_flex
    if not compile:
        return flex_attention
    if _compiled_flex is None:
        # dynamic=False: automatic-dynamic recompiles on a new length fail on CPU (docs/architecture.md, "Facts");
        # rows are fixed.
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flexengine_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    *,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """AttentionInterface function: q [B, Hq, S, D], k/v [B, Hkv, S, D] -> ([B, S, Hq, D], None)."""
    mask: Optional[BatchMask] = kwargs.get(MASK_KWARG)
    if mask is None:
        raise RuntimeError(
            "flexengine attention was called without its batch mask: call the patched model itself "
            "(model(input_ids=..., position_ids=...)), not an inner module"
        )
    for unsupported in ("softcap", "s_aux"):  # Gemma-2 logit soft-capping, attention sinks
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"flexengine attention does not implement {unsupported!r} (this model uses it)")
    gqa = query.shape[1] != key.shape[1]
    if mask.backend == "flex":
        if dropout:
            raise NotImplementedError("FlexAttention has no attention dropout; set the model's attention_dropout=0")
        flex = _flex_fn(getattr(module, "_flexengine_compile", True))
        out_BHSD = flex(query, key, value, block_mask=mask.block_mask, scale=scaling, enable_gqa=gqa)
    else:
        outs = [
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, c.q_start : c.q_end], key[:, :, c.kv_start : c.q_end], value[:, :, c.kv_start : c.q_end],
                attn_mask=c.mask_B1QK, dropout_p=dropout, scale=scaling, enable_gqa=gqa,
            )
            for c in mask.dense_chunks
        ]
        out_BHSD = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # cat of one would copy for nothing
    return out_BHSD.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, flexengine_attention)


def resolve_backend(backend: str, device: Optional[torch.device] = None) -> str:
    """auto -> flex on CUDA, dense on CPU; anything else unchanged."""
    if backend != "auto":
        return backend
    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    return "flex" if on_cuda else "dense"


def _resolve_window(model: nn.Module, mode: str, window: Optional[int]) -> Optional[int]:
    native = getattr(model.config, "sliding_window", None)
    if mode in ("sliding_window", "packed_sliding"):
        window = window if window is not None else native
        if window is None:
            raise ValueError(f"attention mode {mode!r} needs a window: pass window= (attn.window=...)")
        return window
    if native is not None and getattr(model.config, "use_sliding_window", True):
        log.warning(
            "model has a native sliding_window=%s but attention mode %r attends to whole documents; "
            "use mode='packed_sliding' (attn=packed_sliding) to keep the model's window",
            native, mode,
        )
    return None


def patch_attention(
    model: nn.Module,
    mode: str = "packed_doc",
    *,
    window: Optional[int] = None,
    backend: str = "auto",
    block_size: int = 128,
    compile: bool = True,
    dense_chunk: int = 512,
    device: Optional[torch.device] = None,
) -> nn.Module:
    """Make an HF causal LM attend per document / per window; returns the same model, patched in place.

    After patching, `model(input_ids=..., position_ids=...)` treats every run of positions that restarts at 0
    as its own document (or pass `document_ids=` [B, S]). backend: auto | flex | dense | sdpa (HF's own
    attention, unpatched: the padded one-document-per-row baseline). device: where the model runs (decides
    `auto`; default: CUDA if available).
    """
    if mode not in ATTN_MODES:
        raise ValueError(f"mode={mode!r}: choose one of {ATTN_MODES}")
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {ATTN_BACKENDS}")
    _remove_hook(model)
    if backend == "sdpa":
        if mode != "causal":
            raise ValueError(f"backend='sdpa' is HF's own causal attention; mode={mode!r} needs flex or dense")
        model.set_attn_implementation("sdpa")
        model.flexengine_attention = {"mode": mode, "backend": "sdpa", "window": None}
        log.info("attention: mode=causal backend=sdpa (HF's own, one document per row)")
        return model
    resolved = resolve_backend(backend, device)
    if resolved == "flex":
        _check_flex_can_run(compile)
    window = _resolve_window(model, mode, window)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for module in model.modules():
        module._flexengine_compile = compile

    def build_mask_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get(MASK_KWARG) is not None:  # the caller built it already (e.g. the trainer, ahead of time)
            return args, kwargs
        document_ids = kwargs.pop("document_ids", None)
        position_ids = kwargs.get("position_ids")
        input_ids = args[0] if args else kwargs.get("input_ids")
        ref = input_ids if input_ids is not None else kwargs["inputs_embeds"]
        B, S = ref.shape[:2]
        if document_ids is not None:
            if position_ids is None:
                kwargs["position_ids"] = position_ids_from_document_ids(document_ids)
        elif position_ids is not None:
            document_ids = document_ids_from_position_ids(position_ids.expand(B, S))
        elif mode in ("packed_doc", "packed_sliding"):
            raise ValueError(
                f"attention mode {mode!r} needs position_ids that restart at 0 per document (or document_ids)"
            )
        else:
            document_ids = torch.zeros(B, S, dtype=torch.int32, device=ref.device)
        kwargs.update(mask_kwargs(model, document_ids))
        return args, kwargs

    # On the decoder (not the LM head wrapper) so that calls to the decoder alone (chunked loss) also get masks.
    model._flexengine_hook = model.get_decoder().register_forward_pre_hook(build_mask_hook, with_kwargs=True)
    model.flexengine_attention = {"mode": mode, "backend": resolved, "window": window, "block_size": block_size,
                                  "dense_chunk": dense_chunk}
    log.info("attention: mode=%s backend=%s (requested %s) window=%s", mode, resolved, backend, window)
    return model


def mask_kwargs(model: nn.Module, document_ids_BS: Tensor) -> dict:
    """Keyword arguments carrying one batch's mask for a patched model ({} under HF's own sdpa); build them once
    per batch and pass them to `model(...)` or its decoder."""
    attn = model.flexengine_attention
    if attn["backend"] == "sdpa":
        return {}
    mask = build_batch_mask(attn["mode"], attn["backend"], document_ids_BS, attn["window"], attn["block_size"],
                            attn["dense_chunk"])
    return {MASK_KWARG: mask}


def _remove_hook(model: nn.Module) -> None:
    hook = getattr(model, "_flexengine_hook", None)
    if hook is not None:
        hook.remove()
        model._flexengine_hook = None


def _check_flex_can_run(compile: bool) -> None:
    """Refuse loudly rather than fall back: a silent slow path is the #1 cause of slow long-context runs."""
    if not torch.cuda.is_available():
        log.warning(
            "attention backend=flex on CPU: forward works but FlexAttention has no CPU backward; "
            "train on CPU with attn.backend=dense"
        )
    if not compile:
        log.warning(
            "attention backend=flex without compile materialises the full score matrix: correct but slow. "
            "Set attn.compile=true for real runs."
        )
