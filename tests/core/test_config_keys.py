"""The schema's dotted keys, the open-ended ones, and the nearest real key to a typo."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import pytest

from flexengine.core.config import JobConfig
from flexengine.core.config_keys import KNOWN_ALIASES, nearest_key, open_ended_keys, schema_keys, unknown_key_message

KEYS = schema_keys(JobConfig)


def test_schema_keys_expand_nested_groups_and_stop_at_values():
    assert {"train.micro_batch", "optim.lr", "model.lora.r", "model.rope_scaling.factor", "data.mix"} <= set(KEYS)
    assert "model.lora" not in KEYS and "train" not in KEYS  # groups are expanded, not keys themselves
    assert len(KEYS) == len(set(KEYS))


@dataclasses.dataclass
class Inner:
    extra: Optional[Dict[str, int]] = None
    names: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    columns: Dict[str, str] = dataclasses.field(default_factory=dict)


def test_only_dict_typed_fields_are_open_ended():
    assert open_ended_keys(JobConfig) == ["model.arch"]
    assert open_ended_keys(Outer) == ["inner.extra", "columns"]
    assert schema_keys(Outer) == ["inner.extra", "inner.names", "columns"]


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("train.batch_size", "train.micro_batch"),  # another trainer's name: spelling alone says eval_batches
        ("lr", "optim.lr"),  # a top-level key near a nested one
        ("learning_rate", "optim.lr"),
        ("optim.learning_rate", "optim.lr"),
        ("train.microbatch", "train.micro_batch"),
        ("train.max_step", "train.max_steps"),
        ("trian.max_steps", "train.max_steps"),
        ("train.seq_len", "data.seq_len"),
        ("optim.lrate", "optim.lr"),  # the same group counts a little closer ...
        ("train.lrr", "optim.lr"),  # ... but not closer than a much better spelling elsewhere
        ("attn.windw", "attn.window"),
        ("model.lora.rank", "model.lora.r"),
        ("gradient_accumulation_steps", "train.grad_accum"),
    ],
)
def test_nearest_key(typed, meant):
    assert nearest_key(typed, KEYS) == meant


def test_nothing_close_is_no_suggestion():
    assert nearest_key("foo.bar", KEYS) is None
    assert nearest_key("parallel.rank", KEYS) is None  # "rank" alone is not LoRA's


def test_every_alias_points_at_a_real_key():
    assert set(KNOWN_ALIASES.values()) <= set(KEYS)


def test_message_names_each_key_its_origin_and_the_nearest():
    text = unknown_key_message({"train.batch_size": "the command line", "foo": "config experiment/x"}, JobConfig)
    assert "train.batch_size (from the command line: did you mean train.micro_batch?)" in text
    assert "foo (from config experiment/x: no key of the config is close)" in text
    assert "model.arch takes keys of your choosing" in text
    assert "\n" not in text
