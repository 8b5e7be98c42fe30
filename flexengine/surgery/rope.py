"""Positions past the trained context: HF RoPE scaling written into the model's config, and the check that every
document of the packed rows fits the context the model (scaled or not) supports.

Trained context: the positions the checkpoint saw in pretraining, `rope_parameters["original_max_position_
embeddings"]` when its config already carries a scaling, else `max_position_embeddings` (4,096 for
deepseek-llm-7b and Llama-2-7B). Supported context: trained x factor once scaled. Packed rows restart positions
at every document, so what must fit is the longest document piece in a row, not the row.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

from flexengine.core.errors import UserError

log = logging.getLogger(__name__)

# Types whose HF formula needs the pretraining length next to the factor (the others derive it from the config).
_NEEDS_ORIGINAL = ("yarn", "llama3", "longrope")


@dataclass(frozen=True)
class ContextLimits:
    """How many positions a config was trained on and how many it supports with its RoPE scaling."""

    trained: int
    supported: int
    rope_type: str = "default"  # HF rope_type: default (no scaling) | linear | dynamic | yarn | llama3 | ...
    factor: float = 1.0

    def describe(self) -> str:
        """E.g. 'trained on 4096 positions, supports 8192 (yarn x2)'."""
        if self.rope_type == "default":
            return f"trained on {self.trained} positions, no RoPE scaling"
        return f"trained on {self.trained} positions, supports {self.supported} ({self.rope_type} x{self.factor:g})"


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" not in params and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # per-layer-type RoPE (Gemma-style)
    return params


def context_limits(config) -> ContextLimits:
    """The trained and supported context of an HF config (see the module docstring)."""
    params = _rope_parameters(config)
    max_pos = int(config.max_position_embeddings)
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = float(params.get("factor") or 1.0)
    if rope_type == "default":
        return ContextLimits(max_pos, max_pos)
    if rope_type in _NEEDS_ORIGINAL:  # Llama-3.1: original 8192, max 131072; Qwen2.5-yarn: max == original
        trained = int(params.get("original_max_position_embeddings") or max_pos)
        return ContextLimits(trained, max(max_pos, int(trained * factor)), rope_type, factor)
    if rope_type == "dynamic":  # NTK's formula reads max_position_embeddings as the pretraining length
        return ContextLimits(max_pos, int(max_pos * factor), rope_type, factor)
    # linear (and others): max_position_embeddings already names the stretched context (LongChat: 16384, x8)
    return ContextLimits(max(1, int(max_pos / factor)), max_pos, rope_type, factor)


def apply_rope_scaling(config, scaling: Optional[dict]) -> None:
    """Write model.rope_scaling into an HF config in place, before the model is built (the rotary embedding
    reads it at construction and save_pretrained writes it to config.json)."""
    if not scaling:
        return
    scaling = dict(scaling)
    rope_type = scaling.pop("type", None) or scaling.pop("rope_type")
    factor = float(scaling["factor"])
    current = context_limits(config)
    if current.rope_type != "default":
        if current.rope_type == rope_type and math.isclose(current.factor, factor):
            return  # e.g. continuing from a checkpoint flexengine saved with this scaling: already in config.json
        raise UserError(
            f"model.rope_scaling={{rope_type: {rope_type}, factor: {factor:g}}} would stack on the scaling the "
            f"model's config already has ({current.describe()}). Drop model.rope_scaling to keep it, or give its "
            f"own type and factor ({{rope_type: {current.rope_type}, factor: {current.factor:g}}})."
        )
    params = {k: v for k, v in _rope_parameters(config).items() if k in ("rope_theta", "partial_rotary_factor")}
    params.update(scaling, rope_type=rope_type, factor=factor)
    if rope_type in _NEEDS_ORIGINAL:
        params.setdefault("original_max_position_embeddings", current.trained)
    config.rope_parameters = params
    if rope_type != "dynamic":  # dynamic NTK keeps it as the pretraining length of its formula
        config.max_position_embeddings = int(params.get("original_max_position_embeddings", current.trained) * factor)
    try:
        config.validate_rope()
    except (KeyError, ValueError) as e:
        raise UserError(f"model.rope_scaling={dict(params)}: {e}") from None
    log.info("RoPE scaling: %s", context_limits(config).describe())


def check_context(
    longest_document: int, limits: ContextLimits, seq_len: int, long_docs: str, allow_long_context: bool
) -> None:
    """Stop (or, with model.allow_long_context, warn) when a document in the rows is longer than the context the
    model supports: its positions past that were never trained (or scaled) for."""
    if longest_document <= limits.supported:
        return
    factor = float(math.ceil(longest_document / limits.trained))
    problem = (
        f"the longest document in the packed rows is {longest_document} tokens (data.seq_len={seq_len}, "
        f"data.long_docs={long_docs}), but the model is {limits.describe()}: positions past "
        f"{limits.supported} would be ones it never learned"
    )
    if allow_long_context:
        log.warning("%s; training anyway (model.allow_long_context=true).", problem)
        return
    raise UserError(
        f"{problem}. Choose one:\n"
        f"  model.rope_scaling={{rope_type:yarn,factor:{factor:g}}}   scale RoPE to {int(limits.trained * factor)} "
        "positions (also linear | llama3; saved in config.json)\n"
        f"  data.seq_len={limits.supported}   rows within the context (longer documents are split, truncated or "
        "dropped per data.long_docs, and counted)\n"
        "  model.allow_long_context=true   train past the context as it is"
    )
