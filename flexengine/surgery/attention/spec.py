"""`AttentionSpec`: the attention choice resolved once, from attn.* and the model's own config, at the edge.

Everything downstream (the patch, the mask builder, the trainer, the planner, the doctor) reads this object;
nothing else parses attn.mode or attn.backend. The window is per decoder layer: by default the model's own
`sliding_window`, on the layers its `layer_types` mark "sliding_attention" (all layers when it has none).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch

from flexengine.core.config import AttnConfig
from flexengine.core.errors import UserError
from flexengine.surgery.attention.job_rules import checked_mode
from flexengine.surgery.attention.mask_mode import MaskMode, band_mode, mask_mode
from flexengine.surgery.attention.masks import MODES

log = logging.getLogger(__name__)

SLIDING_LAYER = "sliding_attention"  # HF layer_types values (Qwen2, Gemma-2/3, Cohere2, ...)
FULL_LAYER = "full_attention"


class AttnBackend(Enum):
    """Who computes attention."""

    FLEX = "flex"  # FlexAttention with a BlockMask (CUDA; CPU forward only)
    DENSE = "dense"  # SDPA with a dense boolean mask per query chunk (the CPU reference)
    VARLEN = "varlen"  # CPU: one is_causal SDPA call per document, windows as band chunks (attention/varlen.py)
    HF_SDPA = "sdpa"  # HF's own attention, unpatched: the padded one-document-per-row baseline

    @property
    def patched(self) -> bool:
        """Whether flexengine's attention function (and its per-batch mask) replaces HF's."""
        return self is not AttnBackend.HF_SDPA


@dataclass(frozen=True)
class AttentionSpec:
    """How every decoder layer attends; built by `resolve_attention_spec`."""

    mode: str  # attn.mode: a name of flexengine.surgery.attention.masks.MODES
    backend: AttnBackend
    layer_windows: tuple[Optional[int], ...]  # per decoder layer: sliding window in tokens, None = none
    hf_windows: tuple[Optional[int], ...]  # per layer: the `sliding_window` HF's layer hands the attention
    # function (None where it passes none); it selects the layer's mask, so no layer index is read in a graph
    window_source: str  # where layer_windows came from, for the log and summary.json
    block_size: int = 128  # FlexAttention block size in tokens
    dense_chunk: int = 512  # dense backend: queries per SDPA call
    compile: bool = True  # compile flex_attention

    @property
    def documents(self) -> bool:
        """Rows hold several documents separated by the mask."""
        return MODES[self.mode].documents  # checked once, by resolve_attention_spec (read per layer call)

    @property
    def layer_masks(self) -> tuple[MaskMode, ...]:
        """Per decoder layer: the MaskMode it attends with (its predicate and every form derived from it)."""
        if not self.backend.patched:  # HF's own attention: causal, within the model's window where it has one
            return tuple(band_mode(False, w) for w in self.layer_windows)
        return tuple(mask_mode(self.mode, w) for w in self.layer_windows)

    @property
    def mask_modes(self) -> dict[Optional[int], MaskMode]:
        """HF's per-layer `sliding_window` -> the MaskMode applied there: one mask per distinct mode per batch."""
        return dict(zip(self.hf_windows, self.layer_masks))

    def attended_pairs(self, lengths: list[int]) -> list[int]:
        """(query, key) pairs each layer's mask allows within documents of these lengths, in layer order."""
        counts = {m: m.attended_pairs(lengths) for m in set(self.layer_masks)}
        return [counts[m] for m in self.layer_masks]

    def as_dict(self) -> dict:
        """JSON-ready form (summary.json, doctor)."""
        windows = sorted({w for w in self.layer_windows if w is not None})
        one = len(windows) == 1 and None not in self.layer_windows  # the same window on every layer
        return {
            "mode": self.mode,
            "backend": self.backend.value,
            "documents": self.documents,
            "window": windows[0] if one else (windows or None),
            "layer_windows": list(self.layer_windows),
            "window_source": self.window_source,
            "block_size": self.block_size,
            "compile": self.compile,
        }

    def describe(self) -> str:
        """One log line: mode, backend and the windows with their source."""
        groups = Counter(self.layer_windows)  # in layer order: a Counter keeps first-seen order
        windows = ", ".join(f"{'none' if w is None else w} on {n} layer{'s' * (n > 1)}" for w, n in groups.items())
        return f"mode={self.mode} backend={self.backend.value} window: {windows} (from {self.window_source})"


def resolve_backend(backend: str, device: Optional[torch.device] = None) -> AttnBackend:
    """attn.backend -> AttnBackend; auto = flex on CUDA, varlen on CPU (device None: CUDA if available)."""
    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if backend != "auto":
        if backend == "varlen" and on_cuda:
            raise UserError("attn.backend=varlen runs SDPA's CPU kernels; on CUDA use attn.backend=flex (or auto).")
        return AttnBackend(backend)
    return AttnBackend.FLEX if on_cuda else AttnBackend.VARLEN


def native_layer_windows(hf_config) -> tuple[tuple[Optional[int], ...], str]:
    """The model's own sliding window per decoder layer, and where it came from (the HF config field)."""
    n_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:  # Qwen2: a window that is switched off
        window = None
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return (None,) * n_layers, "the model config (no sliding_window)"
    if not layer_types:
        return (window,) * n_layers, f"the model config: sliding_window={window} on every layer"
    unknown = sorted(set(layer_types) - {SLIDING_LAYER, FULL_LAYER})
    if unknown:
        raise UserError(
            f"the model config's layer_types has {unknown}: flexengine masks only {SLIDING_LAYER!r} "
            f"and {FULL_LAYER!r} layers; use attn.backend=sdpa for this model."
        )
    if len(layer_types) != n_layers:
        raise UserError(f"the model config has {len(layer_types)} layer_types for {n_layers} layers.")
    windows = tuple(window if t == SLIDING_LAYER else None for t in layer_types)
    n = sum(w is not None for w in windows)
    return windows, f"the model config: sliding_window={window} on the {n} {SLIDING_LAYER} layers of layer_types"


def resolve_attention_spec(attn: AttnConfig, hf_config, *, device: Optional[torch.device] = None) -> AttentionSpec:
    """attn.* + the model's HF config -> AttentionSpec (UserError naming the key on a bad combination)."""
    mode, entry, backend = attn.mode, checked_mode(attn), resolve_backend(attn.backend, device)
    native, native_source = native_layer_windows(hf_config)
    windowed_layers = [i for i, w in enumerate(native) if w is not None]
    if not backend.patched:
        if entry.windowed or mask_mode(mode) != band_mode(False, None):  # HF's own: causal per row only
            raise UserError(
                f"attn.backend=sdpa is HF's own causal attention; attn={mode} needs "
                "attn.backend=flex, varlen, dense or auto."
            )
        windows, source = native, f"HF's own attention ({native_source})"
    elif entry.windowed:
        if attn.window is not None:
            # on the model's windowed layers only (its full-attention layers stay full), every layer if none
            layers = windowed_layers or range(len(native))
            windows = tuple(attn.window if i in layers else None for i in range(len(native)))
            source = f"attn.window={attn.window}" + (
                f" on the model's {len(windowed_layers)} windowed layers"
                if 0 < len(windowed_layers) < len(native)
                else ""
            )
        elif windowed_layers:
            windows, source = native, native_source
        else:
            raise UserError(
                f"attn={mode} needs a window, and {native_source} gives none: set attn.window=N "
                "(tokens), or use attn=packed_doc."
            )
    else:
        windows = (None,) * len(native)
        source = f"attn={mode} (no window)"
        if windowed_layers:
            log.warning(
                "the model has its own sliding window (%s) but attn=%s attends to whole documents; use "
                "attn=packed_sliding to keep the model's window",
                native_source,
                mode,
            )
            source += f"; the model's own window is not used ({native_source})"
    spec = AttentionSpec(mode, backend, windows, native, source, attn.block_size, attn.dense_chunk, attn.compile)
    if backend is AttnBackend.VARLEN and any(m.inner.varlen_window is None for m in spec.layer_masks):
        raise UserError(
            f"attn.backend=varlen runs causal and sliding-window masks only; attn={mode} needs "
            "attn.backend=dense (CPU) or flex (CUDA)."
        )
    return spec
