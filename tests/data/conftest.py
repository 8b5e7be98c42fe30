"""Data-test fixtures: the demo tokenizer (trained once per session), a ChatML variant, JSONL writers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexengine.data.demo import load_demo_tokenizer
from tests.helpers import with_chatml


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    """The session's flexengine cache (the same directory conftest's FLEXENGINE_CACHE points at)."""
    return tmp_path_factory.getbasetemp() / "flexengine-cache"


@pytest.fixture
def demo_tokenizer(cache_root):
    """A fresh demo tokenizer object (trained once per session, then loaded from disk)."""
    return load_demo_tokenizer(cache_root)


@pytest.fixture
def chat_tokenizer(cache_root):
    """The demo tokenizer with ChatML special tokens and chat template, like an instruct model's."""
    return with_chatml(load_demo_tokenizer(cache_root))


@pytest.fixture
def instruct_tokenizer(cache_root):
    """Like an instruct model's (SmolLM2-, Qwen2.5-Instruct): ChatML, and its eos is the chat end-of-turn
    <|im_end|>, while the base model's end-of-text <|endoftext|> stays in the vocabulary."""
    return with_chatml(load_demo_tokenizer(cache_root), eos="<|im_end|>")


def _write_lines(path: Path, lines: list[str]) -> Path:
    path = Path(path)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def write_lines():
    """write_lines(path, lines): raw lines, so tests can plant malformed records at known line numbers."""
    return _write_lines


@pytest.fixture
def write_jsonl():
    """write_jsonl(path, records): one JSON record per line."""
    return lambda path, records: _write_lines(path, [json.dumps(r) for r in records])
