"""The README's inline override examples compose under Hydra exactly as a user would type them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from flexengine.cli.common import compose_job

README = Path(__file__).resolve().parents[1] / "README.md"


def test_memory_layers_block_list_example_composes():
    """The block-list example for memory.layers is written so that a shell + Hydra take it as one string (a bare
    `memory.layers=0,3,7` is read by Hydra as a sweep and refused)."""
    text = README.read_text(encoding="utf-8")
    examples = [m for m in re.findall(r"`([^`]*memory\.layers=[^`]*)`", text) if "," in m]
    assert examples, "the README shows no block-list example for memory.layers"
    for example in examples:
        (override,) = shlex.split(example)  # what the shell hands to the program
        job = compose_job(["memory=full", override, "model.arch.num_hidden_layers=8"])
        assert job.memory.layers == "0,3,7", example
