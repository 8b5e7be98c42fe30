"""The memory package's public names (flexengine/surgery/memory/__init__.py): exactly the ones a caller needs, each
the object of the module that defines it (a name re-exported twice would hide where to read its code)."""

from __future__ import annotations

import importlib

import pytest

import flexengine.surgery.memory as memory

HOME = {  # written out by hand: where each public name is defined
    "ActivationReport": "meter",
    "MemorySpec": "spec",
    "Recompute": "spec",
    "apply_memory_policy": "policy",
    "block_memory_specs": "spec",
    "decoder_layers": "layers",
    "measure_activations": "meter",
    "select_layers": "layers",
}


def test_all_lists_the_public_names():
    assert sorted(memory.__all__) == sorted(HOME)


@pytest.mark.parametrize("name", sorted(HOME))
def test_each_name_is_its_defining_modules_object(name):
    module = importlib.import_module(f"flexengine.surgery.memory.{HOME[name]}")
    value = getattr(memory, name)
    assert value is getattr(module, name) and value.__module__ == module.__name__
