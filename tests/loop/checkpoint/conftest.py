"""Fixtures of the checkpoint tests: a tiny model and a run directory with two saved steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexengine.loop.checkpoint.save import save_checkpoint
from tests.helpers import checkpoint_state, make_llama


@pytest.fixture
def model():
    return make_llama()


@pytest.fixture
def run(tmp_path, model) -> Path:
    """checkpoints/step_1 and step_2 of a tiny model."""
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, model, None, checkpoint_state(model, step))
    return root
