"""The CUDA allocator's default: expandable segments unless the user set an allocator variable, and the run's
log line saying which configuration is in force and whose it is."""

from __future__ import annotations

import os

import pytest

from flexengine.core import allocator
from flexengine.core.allocator import (
    ALLOC_CONF_NAMES,
    DEFAULT_ALLOC_CONF,
    DEFAULT_MARK,
    DEFAULT_NAME,
    allocator_line,
    default_allocator_conf,
)


def test_the_default_turns_expandable_segments_on():
    env: dict[str, str] = {}
    assert default_allocator_conf(env)
    assert env[DEFAULT_NAME] == DEFAULT_ALLOC_CONF == "expandable_segments:True"
    assert allocator_line(env) == (
        "allocator: expandable_segments:True (flexengine default; set PYTORCH_CUDA_ALLOC_CONF to change)"
    )
    assert not default_allocator_conf(env)  # a second call (torchrun worker, sweep job) changes nothing


@pytest.mark.parametrize("name", ALLOC_CONF_NAMES)
@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:128", ""])
def test_a_users_variable_is_kept_under_any_name_torch_reads(name, value):
    """Off when the user says so; and no second variable that could override theirs by the version's precedence."""
    env = {name: value}
    assert not default_allocator_conf(env)
    assert env == {name: value}
    assert allocator_line(env) == f"allocator: {name}={value} (yours)"


def test_a_child_process_tells_the_inherited_default_from_its_own_setting():
    inherited = {DEFAULT_NAME: DEFAULT_ALLOC_CONF, DEFAULT_MARK: DEFAULT_ALLOC_CONF}
    assert "flexengine default" in allocator_line(inherited)
    changed = {**inherited, DEFAULT_NAME: "expandable_segments:False"}
    assert allocator_line(changed) == "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (yours)"
    both = {**inherited, "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert allocator_line(both).endswith("(yours)")  # which one PyTorch takes depends on its version: both shown


def test_without_flexengine_cli_the_line_says_pytorchs_default():
    line = allocator_line({})
    assert line.startswith("allocator: PyTorch's default, no expandable segments")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line


def test_a_default_set_after_torch_was_imported_is_flagged(monkeypatch):
    """PyTorch reads the variable when its CUDA library loads: set later, it may not be in force (torch is
    imported in this test process already)."""
    for name in (*ALLOC_CONF_NAMES, DEFAULT_MARK):
        monkeypatch.setenv(name, "placeholder")  # records the original state, restored after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(allocator, "_SET_AFTER_TORCH", [False])
    assert default_allocator_conf()
    assert os.environ[DEFAULT_NAME] == DEFAULT_ALLOC_CONF
    assert "set after torch was imported" in allocator_line()
