"""The rules that tie attn.mode to the rest of a job (flexengine/surgery/attention/job_rules.py), on hand-built jobs:
which mode packs, what data.packing=auto becomes, and each refusal naming the keys to change."""

from __future__ import annotations

import pytest

from flexengine.core.config import AttnConfig, DataConfig, JobConfig, ModelConfig, RopeScalingConfig
from flexengine.core.errors import UserError
from flexengine.surgery.attention.job_rules import checked_mode, mode_entry, packs_documents, resolve_attention_rules
from flexengine.surgery.attention.masks import MODES

# what each shipped mode means, written out by hand (conf/attn/*.yaml): does it pack, does it take a window
SHIPPED = {
    "causal": (False, False),
    "packed_doc": (True, False),
    "sliding_window": (False, True),
    "packed_sliding": (True, True),
}


def _job(mode: str, *, window=None, seq_len=1024, packing="auto", model=None) -> JobConfig:
    return JobConfig(
        attn=AttnConfig(mode=mode, window=window),
        data=DataConfig(seq_len=seq_len, packing=packing),
        model=model or ModelConfig(arch={"model_type": "llama", "max_position_embeddings": 4096}),
    )


def _resolved(job: JobConfig) -> JobConfig:
    """The job after resolve_attention_rules, which reads its attn, data and model sections (data in place)."""
    resolve_attention_rules(job.attn, job.data, job.model)
    return job


@pytest.mark.parametrize("mode", sorted(SHIPPED))
def test_each_shipped_mode_packs_and_takes_a_window_as_documented(mode):
    documents, windowed = SHIPPED[mode]
    assert packs_documents(mode) is documents
    assert mode_entry(mode) is MODES[mode] and mode_entry(mode).windowed is windowed


def test_an_unknown_mode_is_refused_listing_the_table():
    with pytest.raises(UserError) as err:
        mode_entry("prefix_lm")
    assert str(err.value) == f"attn.mode='prefix_lm' is not valid; choose one of {', '.join(MODES)}."


def test_a_window_is_refused_on_a_mode_that_takes_none():
    with pytest.raises(UserError, match="attn.window=64 is set but attn=packed_doc has no sliding window"):
        checked_mode(AttnConfig(mode="packed_doc", window=64))
    assert checked_mode(AttnConfig(mode="packed_sliding", window=64)) is MODES["packed_sliding"]


@pytest.mark.parametrize(("mode", "packing"), [(m, "bfd" if d else "none") for m, (d, _) in SHIPPED.items()])
def test_auto_packing_follows_the_mode_in_place_and_twice_the_same(mode, packing):
    job = _job(mode)
    assert _resolved(job).data.packing == packing
    assert _resolved(job).data.packing == packing  # idempotent: a resolved job passes again


@pytest.mark.parametrize(
    ("mode", "kwargs", "needle"),
    [
        ("packed_sliding", dict(window=2048, seq_len=1024), "attn.window=2048 is longer than data.seq_len=1024"),
        ("packed_doc", dict(packing="none"), "attn=packed_doc masks packed documents but data.packing=none"),
        ("causal", dict(packing="greedy"), r"attn=causal has no per-document mask.*\(data.packing=greedy\)"),
    ],
)
def test_a_mode_at_odds_with_the_data_is_refused_naming_both_keys(mode, kwargs, needle):
    with pytest.raises(UserError, match=needle):
        _resolved(_job(mode, **kwargs))


def test_position_dependent_rope_is_checked_against_the_context_composition_can_see():
    dynamic = RopeScalingConfig(rope_type="dynamic", factor=2.0)  # reads model.arch's max_position_embeddings
    arch = {"model_type": "llama", "max_position_embeddings": 4096}
    _resolved(_job("packed_doc", seq_len=4096, model=ModelConfig(arch=arch, rope_scaling=dynamic)))
    with pytest.raises(UserError, match="rows of data.seq_len=8192 pass the trained context of 4096 positions"):
        _resolved(_job("packed_doc", seq_len=8192, model=ModelConfig(arch=arch, rope_scaling=dynamic)))
    # longrope's own original_max_position_embeddings is the trained context, whatever the arch says
    longrope = RopeScalingConfig(rope_type="dynamic", factor=2.0)
    longrope.rope_type, longrope.original_max_position_embeddings = "longrope", 2048  # not a schema choice
    with pytest.raises(UserError, match="trained context of 2048 positions"):
        _resolved(_job("causal", seq_len=4096, model=ModelConfig(arch=arch, rope_scaling=longrope)))
    # with model.path, config.json tells the trained context: checked at run time, not here
    from_path = ModelConfig(path="/models/m", rope_scaling=dynamic)
    assert _resolved(_job("packed_doc", seq_len=65536, model=from_path)).data.packing == "bfd"
