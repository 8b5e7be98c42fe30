"""Shared fixtures (helpers that tests import live in tests/helpers.py, not here), and the test tiers.

Tiers are markers (pyproject.toml registers them; the default `pytest` deselects all but the unit tests):
- `integration`: builds a run, trains through the entry point or starts a process. Every test under
  tests/integration/ is one; elsewhere a test is marked when its code, the test module's own functions it calls or
  the fixtures it uses name one of RUN_NAMES or a torchrun launch (`tier_of` reads the compiled code, so a new test
  lands in its tier without a marker).
- `distributed`: starts several processes that form a process group (torchrun, `mp.spawn`).
- `packaging`: builds the wheel (tests/test_packaging.py). `lint`: runs ruff or mypy (tests/test_lint.py).
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from tests.helpers import make_llama

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests plan without measuring the machine (seconds per process, and plans that would vary with the load): their
# step times are the unknown-speed ranking figures. The tests of the measured speed turn it back on.
os.environ.setdefault("FLEXENGINE_DEVICE_SPEED", "off")

TESTS = Path(__file__).resolve().parent
INTEGRATION_DIR = TESTS / "integration"
# a run (the doctor's too; tests.helpers.run_entry_point: `python -m flexengine.train` in this process), or a process
RUN_NAMES = {
    "run_training",
    "build_trainer",
    "build_planned_trainer",
    "diagnose",
    "run_doctor",
    "subprocess",
    "run_grads_script",
    "run_entry_point",
}
LAUNCH_NAMES = {"python_launcher", "spawn"}  # torchrun (tests.helpers) or torch.multiprocessing.spawn
LAUNCH_TEXT = ("torch.distributed.run", "--nproc_per_node")
TIER_OF_FILE = {"test_packaging.py": "packaging"}


def _code_of(obj) -> types.CodeType | None:
    obj = getattr(obj, "__func__", obj)  # a method
    obj = getattr(obj, "__wrapped__", obj)  # a fixture's or a decorator's wrapped function
    return getattr(obj, "__code__", None)


def _reached(func, module: str) -> tuple[set[str], set[str]]:
    """The global/attribute names and the string constants (keyword names included) of `func`'s code, of the code
    nested in it, and of every function of its own test module it names, followed to the end."""
    names: set[str] = set()
    texts: set[str] = set()
    seen: set[types.CodeType] = set()
    todo = [c for c in [_code_of(func)] if c is not None]
    scope = getattr(getattr(func, "__func__", func), "__globals__", {})
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        names.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                todo.append(const)
            elif isinstance(const, str):
                texts.add(const)
            elif isinstance(const, tuple):
                texts.update(c for c in const if isinstance(c, str))
        for name in code.co_names:
            target = scope.get(name)
            if getattr(target, "__module__", None) == module and (inner := _code_of(target)) is not None:
                todo.append(inner)
    return names, texts


def tier_of(item: pytest.Item) -> set[str]:
    """The tier markers one collected test earns by where it lives and what its code (and its fixtures') names."""
    path = Path(str(item.path)).resolve()
    tiers = {TIER_OF_FILE[path.name]} if path.name in TIER_OF_FILE else set()
    if INTEGRATION_DIR in path.parents:
        tiers.add("integration")
    func = getattr(item, "obj", None)
    if func is None:
        return tiers
    names, texts = _reached(func, func.__module__)
    for defs in item._fixtureinfo.name2fixturedefs.values():  # type: ignore[attr-defined]
        for fixture in defs:
            if getattr(fixture.func, "__module__", "").startswith("tests"):
                more_names, more_texts = _reached(fixture.func, fixture.func.__module__)
                names, texts = names | more_names, texts | more_texts
    launches = bool(names & LAUNCH_NAMES) or any(t in s for s in texts for t in LAUNCH_TEXT)
    launches |= "run_grads_script" in names and "ranks" in texts  # run_grads_script(..., ranks=2): torchrun
    if launches:
        tiers.add("distributed")
    if launches or names & RUN_NAMES:
        tiers.add("integration")
    return tiers


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for tier in sorted(tier_of(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(tier)


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    """A fresh tiny LLaMA (tests.helpers.make_llama)."""
    return make_llama()


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """One demo-tokenizer/data cache per test session (per xdist worker: each has its own base temp directory, so
    no two processes write one cache at once), never the user's ~/.cache."""
    monkeypatch.setenv("FLEXENGINE_CACHE", str(tmp_path_factory.getbasetemp() / "flexengine-cache"))
