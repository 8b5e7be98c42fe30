"""The shared value checks (flexengine/core/config_checks.py): each accepts what it should and refuses the rest with
one message naming the key."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from flexengine.cli.common import compose_job
from flexengine.core.config_checks import (
    check_arch_sizes,
    check_choice,
    check_finite,
    check_fixed_rope,
    parse_tiled_mlp,
)
from flexengine.core.errors import UserError


def test_check_choice_names_the_key_and_every_choice():
    check_choice("data.packing", "bfd", ("bfd", "none"))  # a member passes
    with pytest.raises(UserError) as err:
        check_choice("data.packing", "best", ("bfd", "none"))
    assert str(err.value) == "data.packing='best' is not valid; choose one of bfd, none."


@pytest.mark.parametrize(
    ("value", "bounds", "ok"),
    [
        (0.0, dict(low=0.0), True),  # a closed end includes the bound
        (0.0, dict(low=0.0, low_ok=False), False),  # an open one does not
        (1.0, dict(low=0.0, high=1.0), True),
        (1.0, dict(low=0.0, high=1.0, high_ok=False), False),
        (1e300, dict(low=0.0), True),
        (math.nan, dict(), False),  # NaN compares false with everything: refused however wide the range
        (math.inf, dict(), False),
        (-math.inf, dict(), False),
    ],
)
def test_check_finite_accepts_only_finite_numbers_inside_the_range(value, bounds, ok):
    if ok:
        check_finite("k", value, **bounds)
    else:
        with pytest.raises(UserError, match="k=.* must be a finite number"):
            check_finite("k", value, **bounds)


@pytest.mark.parametrize(
    ("bounds", "where"),
    [
        (dict(low=0.0), ">= 0"),
        (dict(low=0.0, low_ok=False), "> 0"),
        (dict(low=0.0, high=1.0, high_ok=False), "in [0, 1)"),
        (dict(low=0.0, low_ok=False, high=1.0), "in (0, 1]"),
    ],
)
def test_check_finite_says_the_allowed_range_in_interval_notation(bounds, where):
    with pytest.raises(UserError) as err:
        check_finite("optim.x", math.nan, hint=" (hint)", **bounds)
    assert str(err.value) == f"optim.x=nan must be a finite number {where} (hint)."


@pytest.mark.parametrize("bad", [0, -4, True, "8", 2.0])
def test_check_arch_sizes_refuses_anything_but_a_positive_int(bad):
    with pytest.raises(UserError, match=rf"config.json.hidden_size={bad!r} must be a positive integer"):
        check_arch_sizes({"hidden_size": bad}, "config.json")


def test_check_arch_sizes_reads_dicts_and_objects_and_skips_unset_keys():
    check_arch_sizes({"hidden_size": 64, "head_dim": None, "unrelated": -1}, "model.arch")
    check_arch_sizes(SimpleNamespace(num_hidden_layers=2), "model.arch")
    with pytest.raises(UserError, match=r"model.arch.num_hidden_layers=0"):
        check_arch_sizes(SimpleNamespace(num_hidden_layers=0), "model.arch")


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"])
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_model_sizes_fail_at_composition_naming_the_key(key, value):
    with pytest.raises(UserError, match=rf"model\.arch\.{key}={value} must be a positive integer"):
        compose_job([f"model.arch.{key}={value}"])


@pytest.mark.parametrize(
    ("value", "parsed"),
    [(None, 0), (False, 0), ("off", 0), ("none", 0), (0, 0), ("auto", "auto"), (4096, 4096), (" 512 ", 512)],
)
def test_parse_tiled_mlp_reads_off_auto_and_tokens(value, parsed):
    assert parse_tiled_mlp(value) == parsed


@pytest.mark.parametrize("bad", [True, -1, "lots", 1.5, "-3"])
def test_parse_tiled_mlp_refuses_other_values_saying_what_to_give(bad):
    with pytest.raises(UserError, match=r"memory.tiled_mlp=.*give tokens per tile"):
        parse_tiled_mlp(bad)


def test_fixed_rope_passes_fixed_scalings_and_rows_within_the_trained_context():
    for rope_type in (None, "linear", "yarn", "llama3"):
        check_fixed_rope(rope_type, "model.rope_scaling", cp=4, attn_mode="packed_doc", packs=True)
    check_fixed_rope("dynamic", "config.json", cp=4, attn_mode="packed_doc", rows=(4096, 4096))  # equal: within
    check_fixed_rope("dynamic", "config.json", cp=1, attn_mode=None)  # no attention mode given: nothing to check


def test_fixed_rope_refuses_context_parallelism_naming_the_rows_past_the_context():
    with pytest.raises(UserError) as err:
        check_fixed_rope("longrope", "config.json", cp=2, rows=(8192, 4096), instead="X")
    text = str(err.value)
    assert text.startswith("parallel.cp=2 cannot train with config.json rope_type=longrope: rows of data.seq_len=8192")
    assert "pass the trained context of 4096 positions" in text and "Use a fixed scaling, X, or parallel.cp=1." in text


@pytest.mark.parametrize(("packs", "why"), [(True, "a packed document would be rotated"), (False, "a row would be")])
def test_fixed_rope_refuses_an_attention_mode_past_the_context_saying_why(packs, why):
    with pytest.raises(UserError) as err:
        check_fixed_rope("dynamic", "model.rope_scaling", attn_mode="causal", packs=packs, rows=(8192, None))
    text = str(err.value)
    assert text.startswith("attn=causal cannot train with model.rope_scaling rope_type=dynamic: that RoPE derives")
    assert why in text
