"""The offline demo corpus and tokenizer (flexengine/data/demo.py): files spread over the standard library, read as
text; the tokenizer trained once and then loaded from its cache directory."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from flexengine.data import demo


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEXENGINE_CACHE", str(tmp_path / "c"))
    assert demo.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FLEXENGINE_CACHE")
    assert demo.default_cache_dir() == Path.home() / ".cache" / "flexengine"


def _fake_stdlib(monkeypatch, root: Path) -> list[Path]:
    """A standard library of 25 sources, plus an empty file and an installed package, which are not sources."""
    files = [root / f"m{i:02d}.py" for i in range(20)] + [root / "pkg" / f"s{i}.py" for i in range(5)]
    for i, f in enumerate(files):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x = 1\n" * (i + 1))
    (root / "empty.py").write_text("")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "other.py").write_text("y = 2\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    return sorted(files)


def test_source_files_are_spread_over_the_sorted_stdlib(monkeypatch, tmp_path):
    every = _fake_stdlib(monkeypatch, tmp_path)
    picked = demo.demo_source_files(10)
    assert picked == every[::2][:10]  # 25 // 10 = every 2nd file: across the library, not its first package
    assert demo.demo_source_files(100) == every  # asking for more than there are gives them all
    [(name, text)] = list(demo.iter_demo_documents(1))
    assert name == str(every[0]) and text == "x = 1\n"


def test_no_sources_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=f"no Python sources under {tmp_path}"):
        demo.demo_source_files(5)


def test_tokenizer_is_loaded_from_its_cache_without_training_again(monkeypatch, cache_root):
    first = demo.load_demo_tokenizer(cache_root)  # trained once per session (tests/data/conftest.py)
    assert len(first) == demo.DEMO_VOCAB_SIZE
    assert first.eos_token == demo.EOS_TOKEN and first.pad_token == demo.PAD_TOKEN

    def no_training(max_files):
        raise AssertionError("the cached tokenizer was trained again")

    monkeypatch.setattr(demo, "iter_demo_documents", no_training)
    again = demo.load_demo_tokenizer(cache_root)
    text = "def f(x):\n    return x + 1\n"
    assert again(text)["input_ids"] == first(text)["input_ids"]
    assert again.decode(again(text)["input_ids"]) == text  # byte-level: decoding gives the text back
