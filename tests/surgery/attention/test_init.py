"""The attention package's names (flexengine/surgery/attention/__init__.py), imported on first use: each is the
object its submodule defines, and importing the package loads no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import flexengine.surgery.attention as attention

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "flexengine.surgery.attention"


@pytest.mark.parametrize("name", sorted(attention.__all__))
def test_every_lazy_name_is_defined_by_the_submodule_it_is_taken_from(name):
    module = importlib.import_module(f"{PACKAGE}.{attention._LAZY[name]}")
    value = getattr(attention, name)
    assert value is getattr(module, name)
    if hasattr(value, "__module__") and callable(value):  # a class or function says where it was defined
        assert value.__module__ == module.__name__, f"{name} is re-exported by {module.__name__}: name its home"


def test_the_mask_mode_function_comes_from_its_module_not_the_package():
    from flexengine.surgery.attention.mask_mode import mask_mode

    assert "mask_mode" not in attention.__all__  # the package attribute of that name is the submodule
    assert callable(mask_mode) and mask_mode("packed_doc").name


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match=f"module '{PACKAGE}' has no attribute 'BlockMask'"):
        _ = attention.BlockMask


def test_importing_the_package_loads_no_torch():
    code = f"import sys, {PACKAGE}; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
