"""The rules that tie attn.mode to the rest of a job (data packing, window length, RoPE), checked at composition.

They need what a mode means (does it pack documents, does it take a window), which only the mode table knows
(`flexengine.surgery.attention.masks.MODES`); the config schemas in core stay free of any mode list, so a new mode
is one `MODES` entry (and its mask class) plus its conf/attn YAML. Every entry point calls `resolve_attention_rules`
on the composed job before anything reads it: flexengine.cli.common.to_job_config and flexengine.run.
"""

from __future__ import annotations

from typing import Optional

from flexengine.core.config import AttnConfig, DataConfig, ModelConfig, check_choice, check_fixed_rope
from flexengine.core.errors import UserError
from flexengine.surgery.attention.masks import MODES, ModeEntry


def mode_entry(mode: str) -> ModeEntry:
    """attn.mode's table entry (UserError naming the key and the choices on an unknown mode)."""
    check_choice("attn.mode", mode, tuple(MODES))
    return MODES[mode]


def checked_mode(attn: AttnConfig) -> ModeEntry:
    """attn.mode's entry, with attn.window refused on a mode that takes none."""
    entry = mode_entry(attn.mode)
    if attn.window is not None and not entry.windowed:
        raise UserError(
            f"attn.window={attn.window} is set but attn={attn.mode} has no sliding window; "
            "use attn=packed_sliding (or attn=sliding_window), or drop attn.window."
        )
    return entry


def packs_documents(mode: str) -> bool:
    """Whether attn.mode puts several documents in a row, separated by the mask (else one document per row)."""
    return mode_entry(mode).documents


def resolve_attention_rules(attn: AttnConfig, data: DataConfig, model: ModelConfig) -> None:
    """Check attn.* against the job's data.* and model.* and resolve data.packing=auto (bfd when the mode packs,
    else none); in place, idempotent."""
    entry = checked_mode(attn)
    seq_len = data.fixed_seq_len  # None: data.seq_len=auto, checked again once the length is chosen (flexengine.run)
    if attn.window is not None and seq_len is not None and attn.window > seq_len:
        raise UserError(
            f"attn.window={attn.window} is longer than data.seq_len={data.seq_len}: the window would never "
            "apply. Lower attn.window or use attn=packed_doc."
        )
    if data.packing == "auto":
        data.packing = "bfd" if entry.documents else "none"
    if entry.documents and data.packing == "none":
        raise UserError(
            f"attn={attn.mode} masks packed documents but data.packing=none puts one per row; "
            "use data.packing=bfd (or attn=causal for the padded baseline)."
        )
    if not entry.documents and data.packing != "none":
        raise UserError(
            f"attn={attn.mode} has no per-document mask, so packing several documents into one row "
            f"(data.packing={data.packing}) would let them attend to each other. Use attn=packed_doc, "
            "or data.packing=none for one document per row."
        )
    # model.path's config.json (or an auto length) is checked at run time (flexengine.run)
    if seq_len is not None and _trained_context(model) is not None:
        rows = (data.seq_len, _trained_context(model))
        check_fixed_rope(
            model.rope_scaling.rope_type,
            "model.rope_scaling",
            attn_mode=attn.mode,
            packs=entry.documents,
            rows=rows,
        )


def _trained_context(model: ModelConfig) -> Optional[int]:
    """The trained context composition can see for a position-dependent RoPE: longrope's
    original_max_position_embeddings, else model.arch's max_position_embeddings (what dynamic NTK reads); None
    with model.path, whose config.json is read at run time."""
    scaling = model.rope_scaling
    if scaling.rope_type == "longrope" and scaling.original_max_position_embeddings:
        return scaling.original_max_position_embeddings
    return None if model.path else model.arch.get("max_position_embeddings")
