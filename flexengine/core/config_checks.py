"""The value checks and choice lists the config schemas share: each raises `UserError` naming the key to change.

Kept apart from the schemas (config_model, config_data) so that those read as fields; `config.py` re-exports
every name other modules use.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from flexengine.core.data_formats import FORMATS
from flexengine.core.errors import UserError
from flexengine.core.optimizers import OPTIMIZERS
from flexengine.core.parallel_spec import ReduceEvery, Strategy

ATTN_BACKENDS = ("auto", "flex", "dense", "varlen", "sdpa")
PACKING_STRATEGIES = ("auto", "bfd", "greedy", "none")
LONG_DOC_POLICIES = ("split", "truncate", "drop")
DATA_FORMATS = tuple(FORMATS)  # the shipped record formats (core/data_formats.py)
DATA_SOURCES = ("demo", "jsonl", "parquet", "hf")
EVAL_OVERLAP = ("auto", "drop", "refuse", "allow")  # data.eval_overlap
MODEL_INITS = ("auto", "pretrained", "random")
ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn", "llama3")
REDUCE_EVERY = tuple(r.value for r in ReduceEvery)  # auto, window, micro_batch
PARALLEL_STRATEGIES = tuple(s.value for s in Strategy)
SCHEDULES = ("cosine", "linear", "constant", "constant_with_warmup", "warmup_stable_decay")
OPTIM_NAMES = tuple(OPTIMIZERS)  # the shipped optimizers (core/optimizers.py)


def check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{key}={value!r} is not valid; choose one of {', '.join(choices)}.")


def check_finite(
    key: str,
    value: float,
    *,
    low: float = -math.inf,
    low_ok: bool = True,
    high: float = math.inf,
    high_ok: bool = True,
    hint: str = "",
) -> None:
    """A number that must be finite and inside [low, high] (open ends where *_ok is False): NaN compares false
    with everything, so without this a NaN slips through every `<` check (grad_clip=nan meant "no clipping")."""
    inside = (value >= low if low_ok else value > low) and (value <= high if high_ok else value < high)
    if not math.isfinite(value) or not inside:
        if math.isinf(high):
            where = f"{'>=' if low_ok else '>'} {low:g}"
        else:
            where = "in " + ("[" if low_ok else "(") + f"{low:g}, {high:g}" + ("]" if high_ok else ")")
        raise UserError(f"{key}={value} must be a finite number {where}{hint}.")


# model.arch sizes a model cannot have zero (or fewer) of: HF builds such a config and fails deep in torch
ARCH_POSITIVE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
)
MAX_SAMPLE_TOKENS = 4096  # train.sample_tokens: generation re-runs the whole row per token (no KV cache)


def check_arch_sizes(arch: Any, where: str) -> None:
    """Positive model sizes (hidden_size, num_hidden_layers, ...) in an HF config dict: `where` names the source
    (model.arch, or model.path's config.json)."""
    for key in ARCH_POSITIVE_KEYS:
        value = arch.get(key) if hasattr(arch, "get") else getattr(arch, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{where}.{key}={value!r} must be a positive integer (e.g. {where}.{key}=256).")


def parse_tiled_mlp(value: Any) -> Any:
    """memory.tiled_mlp: 0/off -> 0, a positive number of tokens per tile, or 'auto' (the planner decides)."""
    if value in (None, False, "off", "none"):
        return 0
    if value == "auto":
        return value
    tokens = value if isinstance(value, int) and not isinstance(value, bool) else -1
    if isinstance(value, str) and value.strip().isdigit():
        tokens = int(value)
    if tokens < 0:
        raise UserError(
            f"memory.tiled_mlp={value!r}: give tokens per tile (e.g. memory.tiled_mlp=4096), 0 for "
            "off, or auto (the planner tiles when that makes the step fit)"
        )
    return tokens


# torch's CP BlockMask (_create_cp_block_mask) is built with FlexAttention's default 128-token blocks
CP_BLOCK_SIZE = 128
# HF RoPE types whose frequencies follow the positions of the tensor they are given (transformers'
# dynamic_rope_update: dynamic NTK rescales by max(position_ids) + 1, longrope picks its short or long factors by
# it, and the result is cached across batches): under CP each rank holds only its share of a row, so the ranks
# would rotate Q and K differently; under packing a document's rotation depends on its neighbours in the batch
# (2.4e-3 in logits for a 600-token document packed next to a 1,000-token one, measured with transformers 5.24)
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
FIXED_ROPE_INSTEAD = "model.rope_scaling={rope_type:yarn,factor:F} (or linear, llama3)"


def check_fixed_rope(
    rope_type: Optional[str],
    source: str,
    *,
    cp: int = 1,
    attn_mode: Optional[str] = None,
    packs: bool = False,
    rows: Optional[tuple[int, Optional[int]]] = None,
    instead: str = FIXED_ROPE_INSTEAD,
) -> None:
    """Refuse a RoPE whose frequencies depend on the positions in the tensor it gets (POSITION_DEPENDENT_ROPE) where
    tokens that belong together would see different ones, or where training would not rotate a row the way the model
    will be run: context parallelism (cp > 1), or any attention mode (attn_mode; packs: it packs documents) once rows
    pass the trained context. rows: (data.seq_len, the trained context or None if unknown yet): rows within the
    trained context leave such a RoPE at the pretrained frequencies, so it is accepted there. `source`: where
    rope_type is set; `instead`: how to set a fixed scaling there."""
    if rope_type not in POSITION_DEPENDENT_ROPE:
        return
    if rows is not None and rows[1] is not None and rows[0] <= rows[1]:
        return  # transformers rescales only past the trained context (max_position_embeddings, or longrope's original)
    past = (
        f"rows of data.seq_len={rows[0]} pass the trained context of {rows[1]} positions, and there that RoPE "
        if rows is not None and rows[1] is not None
        else "that RoPE "
    )
    if cp > 1:
        raise UserError(
            f"parallel.cp={cp} cannot train with {source} rope_type={rope_type}: {past}derives its frequencies "
            "from the largest position id in the tensor it gets, and under context parallelism each rank holds "
            "only its share of the row, so the ranks would rotate queries and keys with different frequencies. "
            f"Use a fixed scaling, {instead}, or parallel.cp=1."
        )
    if attn_mode is None:
        return
    # attn=causal is no remedy: its rows share the batch's largest position, and even at micro_batch=1 the
    # frequencies transformers grew for an earlier, longer batch stay cached for the shorter ones after it
    which = (
        "a packed document would be rotated differently depending on the documents packed next to it and on the "
        "batch before"
        if packs
        else "a row would be rotated by the longest row in its batch, or by a longer batch before it (one "
        "document per row does not help)"
    )
    raise UserError(
        f"attn={attn_mode} cannot train with {source} rope_type={rope_type}: {past}derives its frequencies from the "
        f"largest position id in the batch (and transformers caches them across batches), so {which}, unlike the "
        "model run on one sequence. Use a fixed scaling whose frequencies depend only on the configured length, "
        f"{instead}, or rows within the trained context (data.seq_len), where it keeps the pretrained frequencies."
    )
