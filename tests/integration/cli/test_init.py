"""Every entry point sets the CUDA allocator's default before torch is imported: the `flexengine.cli` package does
it on import, and each console script, `python -m flexengine.<command>` shim and torchrun worker (the same
module) imports that package before anything that could import torch."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from flexengine.core.allocator import ALLOC_CONF_NAMES, DEFAULT_MARK

ROOT = Path(__file__).resolve().parents[3]
SHIMS = ("train", "plan", "doctor", "stats", "sweep")


def _entry_modules() -> set[str]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {target.partition(":")[0] for target in scripts.values()} | {f"flexengine.{s}" for s in SHIMS}


def _first_heavy_or_own_import(module: str) -> str:
    """The first module-level import of `module` that is torch or one of flexengine's own."""
    path = ROOT / (module.replace(".", "/") + ".py")
    for node in ast.parse(path.read_text()).body:
        names = (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        for name in names:
            if name.split(".")[0] in ("torch", "flexengine"):
                return name
    return ""


def test_every_entry_point_imports_the_cli_package_before_torch():
    for module in sorted(_entry_modules()):
        if module.startswith("flexengine.cli."):
            continue  # importing it runs flexengine/cli/__init__.py first
        first = _first_heavy_or_own_import(module)
        assert first.startswith("flexengine.cli."), f"{module}: first imports {first or 'nothing of ours'}"


_PROBE = """
import json, os, runpy, sys
at_torch_import = []
def watch(event, args):
    if event == "import" and args[0] == "torch" and not at_torch_import:
        at_torch_import.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
sys.addaudithook(watch)
sys.argv = ["flexengine.doctor", "--help"]
try:
    runpy.run_module("flexengine.doctor", run_name="__main__")
except SystemExit:
    pass
print(json.dumps({"at_torch_import": at_torch_import, "at_exit": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}))
"""


@pytest.mark.parametrize("users", [None, "expandable_segments:False"])
def test_python_m_flexengine_doctor_sets_the_default_before_importing_torch(users):
    """`python -m flexengine.doctor --help` in a fresh process: its module imports torch at the top, so the
    variable must already be there by then (the user's own value, untouched, when given)."""
    env = {k: v for k, v in os.environ.items() if k not in (*ALLOC_CONF_NAMES, DEFAULT_MARK)}
    if users is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = users
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = users or "expandable_segments:True"
    assert seen == {"at_torch_import": [expected], "at_exit": expected}
