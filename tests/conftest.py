"""Shared fixtures (helpers that tests import live in tests/helpers.py, not here)."""

from __future__ import annotations

import os

import pytest
from transformers import LlamaForCausalLM

from tests.helpers import make_llama

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests plan without measuring the machine (seconds per process, and plans that would vary with the load): their
# step times are the unknown-speed ranking figures. The tests of the measured speed turn it back on.
os.environ.setdefault("FLEXENGINE_DEVICE_SPEED", "off")


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    """A fresh tiny LLaMA (tests.helpers.make_llama)."""
    return make_llama()


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """One demo-tokenizer/data cache per test session, never the user's ~/.cache."""
    monkeypatch.setenv("FLEXENGINE_CACHE", str(tmp_path_factory.getbasetemp() / "flexengine-cache"))
