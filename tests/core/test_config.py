"""Composition-time validation of config values (flexengine/core/config.py): a bad number fails before any work, with
one paragraph naming the key."""

from __future__ import annotations

import pytest

from flexengine.cli.common import compose_job
from flexengine.core.config import MAX_SAMPLE_TOKENS
from flexengine.core.errors import UserError


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=nan", "optim.lr"),
        ("optim.lr=inf", "optim.lr"),
        ("optim.lr=-1e-3", "optim.lr"),
        ("optim.eps=-1e-8", "optim.eps"),
        ("optim.eps=nan", "optim.eps"),
        ("optim.weight_decay=nan", "optim.weight_decay"),
        ("optim.weight_decay=-0.1", "optim.weight_decay"),
        ("optim.grad_clip=nan", "optim.grad_clip"),  # used to mean "no clipping", silently
        ("optim.grad_clip=-1", "optim.grad_clip"),
        ("optim.betas=[1.0,0.95]", r"optim.betas\[0\]"),
        ("optim.betas=[0.9,1.5]", r"optim.betas\[1\]"),
        ("optim.betas=[0.9,nan]", r"optim.betas\[1\]"),
        ("optim.betas=[-0.1,0.95]", r"optim.betas\[0\]"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("optim.min_lr_ratio=nan", "optim.min_lr_ratio"),
    ],
)
def test_bad_optim_values_fail_at_composition_naming_the_key(override, key):
    with pytest.raises(UserError, match=key):
        compose_job([override])


def test_sane_optim_values_compose():
    job = compose_job(["optim.grad_clip=0", "optim.weight_decay=0", "optim.betas=[0,0.999]", "optim.lr=3e-4"])
    assert job.optim.grad_clip == 0 and job.optim.betas == [0, 0.999]


def test_sample_tokens_is_bounded():
    with pytest.raises(UserError, match=rf"train.sample_tokens=100000 must be in 1..{MAX_SAMPLE_TOKENS}"):
        compose_job(["train.sample_tokens=100000"])
    # the tiny model has 8192 positions: within the bound composes
    assert compose_job(["train.sample_tokens=64"]).train.sample_tokens == 64


def test_sample_tokens_past_the_models_positions_is_refused():
    with pytest.raises(UserError, match="max_position_embeddings=512"):
        compose_job(["model.arch.max_position_embeddings=512", "train.sample_tokens=1024", "train.sample_prompts=[hi]"])


def test_full_with_a_granularity_is_refused_without_suggesting_the_unchecked_value():
    """memory=full with a granularity: the message does not offer the (possibly misspelled) value back as a fix."""
    from flexengine.core.config import MemoryConfig

    with pytest.raises(UserError, match=r"memory=full recomputes whole blocks, but memory.granularity='atention'") as e:
        MemoryConfig(policy="full", granularity="atention")
    assert "memory.granularity=atention" not in str(e.value) and "memory=selective" in str(e.value)


def test_the_fused_loss_needs_chunks():
    with pytest.raises(UserError, match=r"loss.fused=true needs loss.chunk_size > 0 .*loss.fused=false"):
        compose_job(["loss.fused=true", "loss.chunk_size=0"])
    with pytest.raises(UserError, match=r"loss.chunk_size=-1 must be >= 0"):
        compose_job(["loss.chunk_size=-1"])
    job = compose_job(["loss.fused=true", "loss.chunk_size=512"])
    assert job.loss.fused and job.loss.chunk_size == 512
    assert not compose_job([]).loss.fused  # off unless asked: plans and numbers stay the chunked loss's
