"""The package's public API (flexengine/__init__.py): four functions imported on first use, so that importing
flexengine costs no torch, and the top-level conf/ importable as flexengine.conf in a checkout."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import flexengine

ROOT = Path(__file__).resolve().parents[1]
DEFINED_IN = {  # written out by hand: where each public function lives
    "pack_documents": "flexengine.data.packing",
    "patch_attention": "flexengine.surgery.attention.patch",
    "apply_attention": "flexengine.surgery.attention.patch",
    "resolve_attention_spec": "flexengine.surgery.attention.spec",
}


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_every_public_name_is_the_function_of_its_module(name):
    assert name in flexengine.__all__
    assert getattr(flexengine, name) is getattr(importlib.import_module(DEFINED_IN[name]), name)


def test_all_lists_exactly_the_public_functions():
    assert sorted(flexengine.__all__) == sorted(DEFINED_IN) == sorted(flexengine._LAZY)


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="module 'flexengine' has no attribute 'pack_document'"):
        _ = flexengine.pack_document


def test_importing_the_package_loads_no_torch():
    code = "import sys, flexengine; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_checkout_imports_its_conf_folder_as_flexengine_conf():
    import flexengine.conf

    assert Path(flexengine.conf.__file__).resolve().parent == ROOT / "conf"
    assert (Path(flexengine.conf.__file__).parent / "config.yaml").is_file()
