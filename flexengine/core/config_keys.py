"""The dotted keys a config schema has, and the nearest one to a key it does not have (for "did you mean").

Hydra refuses a misspelled key set with `key=value`, but one added with `+key=value` (which Hydra's own error
suggests) or `++key=value` lands in the composed config unchecked, and the dataclass conversion then drops it: the
run trains without the setting the user asked for. The entry point refuses such keys, naming the nearest real one
(flexengine.cli.config_errors); this module knows the schema's keys and which of them are open-ended.

Plain dataclass introspection: no Hydra, no OmegaConf, no torch (a config error must stay fast).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Optional

# What other trainers call our keys (HF TrainingArguments, TRL, axolotl, torchtune): a user who types their name
# means ours, and spelling similarity alone picks the wrong one (`train.batch_size` is closer to
# `train.eval_batches` than to `train.micro_batch`). Keyed by the last component(s) of the key typed.
KNOWN_ALIASES = {
    "batch_size": "train.micro_batch",
    "micro_batch_size": "train.micro_batch",
    "per_device_train_batch_size": "train.micro_batch",
    "train_batch_size": "train.micro_batch",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_accumulation": "train.grad_accum",
    "learning_rate": "optim.lr",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "max_seq_length": "data.seq_len",
    "max_seq_len": "data.seq_len",
    "max_length": "data.seq_len",
    "seq_length": "data.seq_len",
    "sequence_len": "data.seq_len",
    "lr_scheduler_type": "optim.schedule",
    "lr_scheduler": "optim.schedule",
    "max_grad_norm": "optim.grad_clip",
    "logging_steps": "train.log_every",
    "save_steps": "train.save_every",
    "eval_steps": "train.eval_every",
    "model_name_or_path": "model.path",
    "base_model": "model.path",
    "lora_r": "model.lora.r",
    "lora_rank": "model.lora.r",
    "lora.rank": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "gradient_checkpointing": "memory.policy",
    "attn_implementation": "attn.backend",
}
SIMILAR = 0.6  # difflib ratio above which two spellings count as the same word mistyped (difflib's own cutoff)
SAME_GROUP_BONUS = 0.1  # a key in the group the user typed is likelier than an equally close one elsewhere


def _field_types(schema: type) -> dict[str, Any]:
    """Each field's resolved type (the schemas use `from __future__ import annotations`: strings until resolved)."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(schema)}


def _dataclass_in(tp: Any) -> Optional[type]:
    """The dataclass a field holds (itself, or inside Optional[...]), else None."""
    held = (tp, *typing.get_args(tp))  # NoneType is no dataclass
    return next((t for t in held if isinstance(t, type) and dataclasses.is_dataclass(t)), None)


def _is_mapping(tp: Any) -> bool:
    origin = typing.get_origin(tp) or tp
    if origin is typing.Union:
        return any(_is_mapping(arg) for arg in typing.get_args(tp))
    return origin in (dict, typing.Dict)


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass schema (`train.micro_batch`, `model.lora.r`), nested dataclasses expanded."""
    out = []
    for name, tp in _field_types(schema).items():
        inner = _dataclass_in(tp)
        if inner is not None and typing.get_origin(tp) not in (list, typing.List):
            out += schema_keys(inner, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def open_ended_keys(schema: type, prefix: str = "") -> list[str]:
    """The keys that take sub-keys of the user's choosing: fields typed as a dict (model.arch: any HF config field).
    Their documentation says so; anything under them is accepted as written."""
    out = []
    for name, tp in _field_types(schema).items():
        inner = _dataclass_in(tp)
        if _is_mapping(tp):
            out.append(prefix + name)
        elif inner is not None:
            out += open_ended_keys(inner, f"{prefix}{name}.")
    return out


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _parent(key: str) -> str:
    return key.rpartition(".")[0]


def nearest_key(key: str, keys: list[str]) -> Optional[str]:
    """The schema key the user most likely meant by `key`, or None when nothing is close.

    In order: another trainer's name for it (KNOWN_ALIASES); the same last component elsewhere (`+lr` ->
    `optim.lr`, `train.seq_len` -> `data.seq_len`); the closest spelling of the last component, a key of the same
    group counting a little closer (`optim.lrate` -> `optim.lr`, but `train.lrr` -> `optim.lr`)."""
    leaf, parent = _leaf(key), _parent(key)
    typed = key.lower()
    alias = next((k for a, k in KNOWN_ALIASES.items() if typed == a or typed.endswith("." + a)), None)
    if alias in keys:
        return alias
    same_leaf = [k for k in keys if _leaf(k) == leaf]
    if same_leaf:
        return next((k for k in same_leaf if _parent(k) == parent), same_leaf[0])

    def score(k: str) -> float:
        similar = difflib.SequenceMatcher(None, leaf, _leaf(k)).ratio()
        return similar + (SAME_GROUP_BONUS if _parent(k) == parent else 0.0)

    best = max(keys, key=score, default=None)
    return best if best is not None and score(best) >= SIMILAR else None


def unknown_key_message(unknown: dict[str, str], schema: type) -> str:
    """One paragraph for keys the schema does not have: each with where it came from and the nearest real key.
    `unknown` maps each dotted key to its origin ("the command line", "a config file")."""
    keys = schema_keys(schema)
    parts = []
    for key, origin in unknown.items():
        near = nearest_key(key, keys)
        hint = f"did you mean {near}?" if near else "no key of the config is close"
        parts.append(f"{key} (from {origin}: {hint})")
    open_ended = open_ended_keys(schema)
    takes = f"{', '.join(open_ended)} take{'s' if len(open_ended) == 1 else ''}" if open_ended else "no key takes"
    return (
        f"unknown config key{'s' if len(parts) > 1 else ''} {'; '.join(parts)}. Only the schema's keys take effect, "
        f"whether set, added with + or ++, or written in a config file ({takes} keys of your choosing). Every "
        "key, as a run of your overrides would use it: flexengine-plan <the same overrides, this one corrected> "
        "plan.format=resolved."
    )
