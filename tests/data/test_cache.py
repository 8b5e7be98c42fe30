"""Tokenize-once cache: hit, miss, invalidation by files / tokenizer / options, atomic entries, .npy streaming."""

from __future__ import annotations

import os

import numpy as np
import pytest

from flexengine.core.config import DataConfig
from flexengine.core.errors import UserError
from flexengine.data import cache
from flexengine.data.corpus import build_corpus
from flexengine.data.encode import Encoder


@pytest.fixture
def jsonl_data(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"def f{i}(x):\n    return x * {i}\n"} for i in range(40)])
    return DataConfig(source="jsonl", path=str(path), cache_dir=str(tmp_path / "cache"), num_workers=0)


@pytest.fixture
def count_encodes(monkeypatch):
    calls = []
    original = Encoder.encode_batch

    def counting(self, docs):
        calls.append(len(docs))
        return original(self, docs)

    monkeypatch.setattr(Encoder, "encode_batch", counting)
    return calls


def test_second_build_is_a_hit_without_tokenizing(jsonl_data, demo_tokenizer, count_encodes):
    first = build_corpus(jsonl_data, demo_tokenizer)
    assert not first.cache_hit and sum(count_encodes) == 40
    second = build_corpus(jsonl_data, demo_tokenizer)
    assert second.cache_hit and sum(count_encodes) == 40  # no encode call on a hit
    assert isinstance(second.tokens, np.memmap) and second.tokens.dtype == np.int32
    np.testing.assert_array_equal(first.tokens, second.tokens)
    np.testing.assert_array_equal(first.offsets, second.offsets)


def test_changed_file_invalidates(jsonl_data, demo_tokenizer, write_jsonl):
    build_corpus(jsonl_data, demo_tokenizer)
    write_jsonl(jsonl_data.path, [{"text": "completely different"}])
    os.utime(jsonl_data.path, ns=(0, 10**18))  # a different mtime even on coarse filesystem clocks
    corpus = build_corpus(jsonl_data, demo_tokenizer)
    assert not corpus.cache_hit and len(corpus) == 1
    eos = demo_tokenizer.eos_token_id
    assert corpus.tokens.tolist() == demo_tokenizer("completely different")["input_ids"] + [eos]


def test_changed_tokenizer_or_options_invalidate(jsonl_data, demo_tokenizer):
    build_corpus(jsonl_data, demo_tokenizer)
    jsonl_data.add_eos = False
    assert not build_corpus(jsonl_data, demo_tokenizer).cache_hit
    demo_tokenizer.add_tokens(["return x"])  # same class and vocab file, one added token
    assert not build_corpus(jsonl_data, demo_tokenizer).cache_hit
    jsonl_data.num_workers = 2  # how we tokenize is not what we tokenize: still a hit
    assert build_corpus(jsonl_data, demo_tokenizer).cache_hit


def test_failed_tokenization_leaves_no_entry(jsonl_data, demo_tokenizer, write_lines):
    write_lines(jsonl_data.path, ['{"text": "ok"}', "{broken"])
    with pytest.raises(UserError, match=":2: "):
        build_corpus(jsonl_data, demo_tokenizer)
    root = cache.corpus_cache_dir(jsonl_data.cache_dir)
    assert list(root.iterdir()) == []  # neither a complete-looking entry nor a temp directory


def test_parallel_workers_match_in_process(jsonl_data, demo_tokenizer, tmp_path):
    serial = build_corpus(jsonl_data, demo_tokenizer)
    jsonl_data.cache_dir, jsonl_data.num_workers = str(tmp_path / "other"), 2
    parallel = build_corpus(jsonl_data, demo_tokenizer)
    assert not parallel.cache_hit
    np.testing.assert_array_equal(serial.tokens, parallel.tokens)
    np.testing.assert_array_equal(serial.offsets, parallel.offsets)


def test_npy_appender_streams_a_loadable_array(tmp_path):
    appender = cache._NpyAppender(tmp_path / "a.npy", np.int32)
    chunks = [np.arange(5), np.array([], dtype=np.int64), np.arange(100, 1100)]
    for chunk in chunks:
        appender.append(chunk)
    appender.close()
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy", mmap_mode="r"), np.concatenate(chunks).astype(np.int32))


def test_mask_file_only_when_something_is_masked(tmp_path):
    for masks, expect_file in (([None, np.array([True, True])], False), ([None, np.array([False, True])], True)):
        directory = tmp_path / f"entry{expect_file}"
        writer = cache.CorpusWriter(directory, with_mask=True)
        writer.append(np.array([1, 2, 3]), masks[0])
        writer.append(np.array([4, 5]), masks[1])
        writer.commit({"skipped": {}})
        tokens, offsets, loss_mask, meta = cache.load_entry(directory)
        assert tokens.tolist() == [1, 2, 3, 4, 5] and offsets.tolist() == [0, 3, 5] and meta["documents"] == 2
        assert (loss_mask is not None) == expect_file
        if expect_file:
            assert loss_mask.tolist() == [True, True, True, False, True]


WRITER = """
import sys, time
from pathlib import Path
from flexengine.data.cache import CorpusWriter
CorpusWriter(Path(sys.argv[1]), with_mask=False)
print("writing", flush=True)
time.sleep(120)
"""


def _tokenizing_process(entry):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(entry)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    return proc


def test_a_tokenizer_killed_by_sigterm_leaves_no_temp_entry_behind(tmp_path):
    """Before: SIGTERM during tokenization left `<key>.tmp<pid>` in the cache forever."""
    corpus = tmp_path / "corpus"
    killed, alive = _tokenizing_process(corpus / "a"), _tokenizing_process(corpus / "b")
    try:
        killed.terminate()  # SIGTERM: the default action, no Python cleanup runs
        killed.wait()
        leftovers = [p.name for p in corpus.iterdir()]
        assert len(leftovers) == 2 and all(".tmp" in name for name in leftovers)
        cache.CorpusWriter(corpus / "c", with_mask=False).abort()  # the next tokenization sweeps
        remaining = [p.name for p in corpus.iterdir()]
        assert remaining == [n for n in leftovers if n.startswith("b.")]  # the live writer's entry is kept
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("damage", ["id_past_the_vocabulary", "negative_id", "offsets_past_the_tokens"])
def test_a_tampered_entry_is_named_and_tokenized_again(jsonl_data, demo_tokenizer, caplog, damage):
    """Before: ids >= the vocabulary were trusted and crashed the first forward with an IndexError."""
    first = build_corpus(jsonl_data, demo_tokenizer)
    entry, expected = first.cache_path, np.array(first.tokens)  # a copy: the memory map sees the tampering
    if damage == "offsets_past_the_tokens":
        offsets = np.load(entry / "offsets.npy")
        offsets[-1] += 7
        np.save(entry / "offsets.npy", offsets)
    else:
        tokens = np.load(entry / "tokens.npy", mmap_mode="r+")
        tokens[5] = len(demo_tokenizer) + 3 if damage == "id_past_the_vocabulary" else -1
        tokens.flush()
        del tokens
    with caplog.at_level("WARNING"):
        again = build_corpus(jsonl_data, demo_tokenizer)
    assert not again.cache_hit and f"data: the cache entry {entry} is damaged" in caplog.text
    np.testing.assert_array_equal(again.tokens, expected)
    assert build_corpus(jsonl_data, demo_tokenizer).cache_hit  # the fresh entry stands
