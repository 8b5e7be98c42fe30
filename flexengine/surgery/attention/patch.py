"""Rewrite a loaded HF causal LM's attention through transformers' own registry (no forked modelling code).

`apply_attention(model, spec)` registers one attention function under the name "flexengine" and a forward
pre-hook on the decoder. The hook builds the batch's masks once from `position_ids` (or `document_ids`) -- one
per distinct window of the spec -- and hands them to every layer as a keyword argument; transformers forwards
extra model kwargs unchanged to the attention function, which picks its layer's mask by the `sliding_window`
HF's layer passes (a constant shared by all layers of one kind, so compiled blocks share their graph).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface

from flexengine.core.config import AttnConfig
from flexengine.surgery.applied import applied, attention_spec
from flexengine.surgery.attention.block_mask import BatchMask, DenseMask, FlexMask, VarlenMask, build_batch_mask
from flexengine.surgery.attention.masks import document_ids_from_position_ids, position_ids_from_document_ids
from flexengine.surgery.attention.spec import AttentionSpec, AttnBackend, resolve_attention_spec
from flexengine.surgery.attention.varlen import varlen_attention
from flexengine.surgery.family import hf_causal_lm

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "flexengine"
MASK_KWARG = "flexengine_mask"
# an attention module's child that replaces the flex call (context parallelism: torch's K/V all-gather hook on it)
CP_ATTENTION = "flexengine_cp_attention"

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


@dataclass
class LayerMasks:
    """One batch's masks for every layer: keyed by the `sliding_window` HF's layer passes (see AttentionSpec)."""

    spec: AttentionSpec
    by_hf_window: dict  # HF's sliding_window (None, or tokens) -> BatchMask

    def for_layer(self, hf_window: Optional[int]) -> BatchMask:
        """The mask of a layer that received `sliding_window=hf_window` from HF."""
        mask = self.by_hf_window.get(hf_window)
        if mask is None:
            raise RuntimeError(
                f"flexengine attention: a layer passed sliding_window={hf_window}, which the model "
                f"config did not announce ({sorted(map(str, self.by_hf_window))})"
            )
        return mask

    @property
    def block_density(self) -> Tensor:
        """Fraction of a causal mask's blocks computed, averaged over the layers; 0-d tensor (no host sync)."""
        per_layer = [self.by_hf_window[w].block_density for w in self.spec.hf_windows]
        return torch.stack(per_layer).float().mean()

    @property
    def executed_pairs(self) -> list:
        """(query, key) pairs each layer's backend computes (BatchMask.executed_pairs), in layer order."""
        return [self.by_hf_window[w].executed_pairs for w in self.spec.hf_windows]


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
    masks: Optional[LayerMasks] = kwargs.get(MASK_KWARG)
    if masks is None:
        raise RuntimeError(
            "flexengine attention was called without its batch mask: call the patched model itself "
            "(model(input_ids=..., position_ids=...)), not an inner module"
        )
    for unsupported in ("softcap", "s_aux"):  # Gemma-2 logit soft-capping, attention sinks
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"flexengine attention does not implement {unsupported!r} (this model uses it)")
    mask = masks.for_layer(kwargs.get("sliding_window"))
    gqa = query.shape[1] != key.shape[1]
    if isinstance(mask, FlexMask):
        if dropout:
            raise NotImplementedError("FlexAttention has no attention dropout; set the model's attention_dropout=0")
        flex = getattr(module, CP_ATTENTION, None)
        flex = _flex_fn(masks.spec.compile) if flex is None else flex
        out_BHSD = flex(query, key, value, block_mask=mask.block_mask, scale=scaling, enable_gqa=gqa)
    elif isinstance(mask, VarlenMask):
        if dropout:
            raise NotImplementedError(
                "attn.backend=varlen has no attention dropout; use attn.backend=dense "
                "or set the model's attention_dropout=0"
            )
        return varlen_attention(query, key, value, mask.varlen_ids, mask.mode.varlen_window, scaling), None
    else:
        assert isinstance(mask, DenseMask)  # build_batch_mask makes only these three kinds
        outs = [
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, c.q_start : c.q_end],
                key[:, :, c.kv_start : c.kv_end],
                value[:, :, c.kv_start : c.kv_end],
                attn_mask=c.mask_B1QK,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=gqa,
            )
            for c in mask.dense_chunks
        ]
        out_BHSD = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # cat of one would copy for nothing
    return out_BHSD.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, flexengine_attention)


def apply_attention(model: nn.Module, spec: AttentionSpec) -> nn.Module:
    """Make an HF causal LM attend as `spec` says; returns the same model, changed in place.

    After it, `model(input_ids=..., position_ids=...)` treats every run of positions that restarts at 0 as its own
    document (or pass `document_ids=` [B, S]); an HF `attention_mask` [B, S] of 1/0 makes padding its own
    segment (`fold_padding`). Recorded in `model.flexengine.attention`.
    """
    lm = hf_causal_lm(model)
    if len(spec.layer_windows) != lm.config.num_hidden_layers:
        raise ValueError(
            f"the spec has {len(spec.layer_windows)} layer windows, the model "
            f"{lm.config.num_hidden_layers} layers: resolve it from this model's config"
        )
    record = applied(model)
    if record.mask_hook is not None:
        record.mask_hook.remove()
        record.mask_hook = None
    record.attention = spec
    if not spec.backend.patched:
        lm.set_attn_implementation("sdpa")
        log.info("attention: %s (HF's own, one document per row)", spec.describe())
        return model
    if spec.backend is AttnBackend.FLEX:
        _check_flex_can_run(spec.compile)
        _flex_fn(spec.compile)  # created here: made lazily inside a traced checkpoint it is a side effect
    lm.set_attn_implementation(ATTN_IMPLEMENTATION)

    def build_mask_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get(MASK_KWARG) is not None:  # the caller built it already (e.g. the trainer, ahead of time)
            return args, kwargs
        document_ids = kwargs.pop("document_ids", None)
        # HF would build its own mask from this; ours folds it into the document ids instead (never ignored)
        attention_mask = kwargs.pop("attention_mask", None)
        position_ids = kwargs.get("position_ids")
        input_ids = args[0] if args else kwargs.get("input_ids")
        ref = input_ids if input_ids is not None else kwargs["inputs_embeds"]
        B, S = ref.shape[:2]
        if document_ids is not None:
            if position_ids is None:
                kwargs["position_ids"] = position_ids_from_document_ids(document_ids)
        elif position_ids is not None:
            document_ids = document_ids_from_position_ids(position_ids.expand(B, S))
        elif spec.documents and attention_mask is None:
            raise ValueError(
                f"attention mode {spec.mode!r} needs position_ids that restart at 0 per document (or document_ids)"
            )
        else:  # one document per row (an HF-style batch: padding, if any, comes from attention_mask)
            document_ids = torch.zeros(B, S, dtype=torch.int32, device=ref.device)
        if attention_mask is not None:
            document_ids = fold_padding(document_ids, attention_mask)
        kwargs.update(mask_kwargs(model, document_ids, separate_documents=attention_mask is not None))
        return args, kwargs

    # On the decoder (not the LM head wrapper) so that calls to the decoder alone (chunked loss) also get masks.
    record.mask_hook = lm.get_decoder().register_forward_pre_hook(build_mask_hook, with_kwargs=True)
    log.info("attention: %s", spec.describe())
    return model


def patch_attention(
    model: nn.Module,
    *,
    mode: str = "packed_doc",
    window: Optional[int] = None,
    backend: str = "auto",
    block_size: int = 128,
    compile: bool = True,
    dense_chunk: int = 512,
    device: Optional[torch.device] = None,
) -> nn.Module:
    """Library shortcut: AttnConfig fields -> `resolve_attention_spec` -> `apply_attention` (raises UserError).

    backend: auto | flex | varlen | dense | sdpa (HF's own attention, unpatched: the padded
    one-document-per-row baseline). window: None = the model's own (per layer). device: where the model runs
    (decides `auto`).
    """
    attn = AttnConfig(
        mode=mode, backend=backend, window=window, block_size=block_size, compile=compile, dense_chunk=dense_chunk
    )
    return apply_attention(model, resolve_attention_spec(attn, hf_causal_lm(model).config, device=device))


def fold_padding(document_ids_BS: Tensor, attention_mask_BS: Tensor) -> Tensor:
    """Document ids with an HF attention_mask folded in: each run of padding (mask 0) becomes a document of its
    own, so real tokens never attend to it (left-padded batches included). Refuses a mask whose padding sits
    inside a document (that would cut it in two) and masks that are not [B, S]. Costs one host sync."""
    if attention_mask_BS.dim() != 2 or attention_mask_BS.shape != document_ids_BS.shape:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask_BS.shape)}: the patched model takes a [B, S] padding "
            f"mask matching the input {tuple(document_ids_BS.shape)} (1 = real token, 0 = padding); express "
            "other masks with document_ids / position_ids"
        )
    real = attention_mask_BS.bool()
    B, S = real.shape
    idx = torch.arange(S, device=real.device).expand(B, S)
    last_real = torch.where(real, idx, -1).cummax(dim=1).values  # last real position <= j
    prev_real = torch.nn.functional.pad(last_real[:, :-1], (1, 0), value=-1)  # last real position < j
    after_gap = real & (prev_real >= 0) & (idx - prev_real > 1)
    same_doc = document_ids_BS.gather(1, prev_real.clamp(min=0)) == document_ids_BS
    split = after_gap & same_doc
    if bool(split.any()):
        r, j = (int(v) for v in split.nonzero()[0])
        raise ValueError(
            f"attention_mask has padding inside a document (row {r}, before position {j}): folding it into its "
            "own segment would cut that document in two. Pad only between documents or at the row ends, or "
            "pass document_ids / position_ids that restart per document"
        )
    # any id no real token uses; canonical_document_ids later renumbers the runs 0, 1, 2, ...
    return torch.where(real, document_ids_BS, document_ids_BS.min() - 1)


def mask_kwargs(model: nn.Module, document_ids_BS: Tensor, separate_documents: bool = False) -> dict:
    """Keyword arguments carrying one batch's masks for a patched model ({} when its attention is HF's own);
    build them once per batch and pass them to `model(...)` or its decoder. separate_documents: apply the
    document ids even without a per-document mode (padding folded in from an attention_mask is its own segment)."""
    spec = attention_spec(model)
    if spec is None or not spec.backend.patched:
        return {}
    built: dict = {}  # MaskMode -> mask: layers with the same mode share one mask
    by_hf = {}
    for hf_window, mode in spec.mask_modes.items():
        mode = mode.packed() if separate_documents else mode
        if mode not in built:
            built[mode] = build_batch_mask(
                document_ids_BS,
                mode=mode,
                backend=spec.backend,
                block_size=spec.block_size,
                dense_chunk=spec.dense_chunk,
            )
        by_hf[hf_window] = built[mode]
    return {MASK_KWARG: LayerMasks(spec, by_hf)}


def _check_flex_can_run(compile: bool) -> None:
    """Warn, naming the fix, where flex will run slowly or not train: on CPU (no backward) and uncompiled (the full
    score matrix). A silent slow path is the most common cause of slow long-context runs."""
    if not torch.cuda.is_available():
        log.warning(
            "attention backend=flex on CPU: forward works but FlexAttention has no CPU backward; "
            "train on CPU with attn.backend=varlen (or dense, the reference)"
        )
    if not compile:
        log.warning(
            "attention backend=flex without compile materialises the full score matrix: correct but slow. "
            "Set attn.compile=true for real runs."
        )
