"""The model.* schema (flexengine/core/config_model.py): RoPE scaling, LoRA and ModelConfig refuse what cannot build,
naming the key, and say what they hand on."""

from __future__ import annotations

import pytest

from flexengine.core.config_model import LoraConfig, ModelConfig, RopeScalingConfig
from flexengine.core.errors import UserError

ARCH = {"model_type": "llama", "hidden_size": 64}


def test_rope_scaling_hands_hf_only_the_keys_that_are_set():
    assert RopeScalingConfig().as_hf() == {}  # no rope_type: no scaling, whatever the other fields say
    yarn = RopeScalingConfig(rope_type="yarn", factor=2.0, beta_fast=16.0)
    assert yarn.as_hf() == {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16.0}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(rope_type="ntk"), "model.rope_scaling.rope_type='ntk' is not valid"),
        (dict(rope_type="linear", factor=0.5), "model.rope_scaling.factor=0.5 must be >= 1"),
    ],
)
def test_rope_scaling_refuses_unknown_types_and_shrinking_factors(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        RopeScalingConfig(**kwargs)
    RopeScalingConfig(factor=0.5)  # without a type the factor is unused: accepted


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(r=-1), "model.lora.r=-1 must be >= 0"),
        (dict(r=8, target_modules=[]), "model.lora.target_modules is empty"),
        (dict(r=8, dropout=1.0), r"model.lora.dropout=1.0 must be in \[0, 1\)"),
        (dict(r=8, dropout=-0.1), "model.lora.dropout=-0.1"),
    ],
)
def test_lora_refuses_what_peft_could_not_build(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        LoraConfig(**kwargs)


def test_lora_off_ignores_an_empty_target_list():
    assert LoraConfig(r=0, target_modules=[]).r == 0


def test_pretrained_init_needs_a_path_and_an_arch_needs_a_model_type():
    with pytest.raises(UserError, match="model=big loads pretrained weights, so model.path must name"):
        ModelConfig(name="big", init="pretrained", arch=ARCH)
    with pytest.raises(UserError, match="model.arch must give at least model_type"):
        ModelConfig(arch={"hidden_size": 64})
    with pytest.raises(UserError, match="model.init='warm' is not valid"):
        ModelConfig(init="warm", arch=ARCH)
    with pytest.raises(UserError, match="model.arch.hidden_size=0"):
        ModelConfig(arch={"model_type": "llama", "hidden_size": 0})
    ModelConfig(path="/models/x")  # a path brings its own config.json: no arch needed


@pytest.mark.parametrize(
    ("path", "init", "loads"),
    [(None, "auto", False), ("/m", "auto", True), ("/m", "pretrained", True), ("/m", "random", False)],
)
def test_weights_load_from_the_path_unless_init_is_random(path, init, loads):
    assert ModelConfig(path=path, init=init, arch=ARCH).loads_weights is loads
