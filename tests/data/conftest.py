"""Data-test fixtures: the demo tokenizer (trained once per session), a ChatML variant, JSONL writers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexengine.data.demo import load_demo_tokenizer

# ChatML, with HF's {% generation %} markers so transformers' own assistant mask can serve as a reference. The
# block closes at <|im_end|>: the newline after it is the template's trailer, which the model never generates.
CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>"
    "{% endgeneration %}{{ '\\n' }}"  # an expression: jinja's trim_blocks would eat a literal newline here
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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
    tok = load_demo_tokenizer(cache_root)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TEMPLATE
    return tok


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
