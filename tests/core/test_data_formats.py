"""flexengine/core/data_formats.py: one DataFormat per data.format. Each shipped format reads the columns and answers
what its entry says; a format added as one entry alone (a test-only upper-cased text) composes, is read from JSONL
and Parquet through its own check, encodes through its own function, and trains two steps through flexengine.train."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flexengine.cli.common import compose_job
from flexengine.core.config import DataConfig
from flexengine.core.data_formats import FORMATS, DataFormat, data_format, function_named
from flexengine.core.errors import UserError
from flexengine.data.corpus import build_corpus
from flexengine.data.demo import load_demo_tokenizer
from flexengine.data.encode import encode_texts
from flexengine.data.sources import BadRecords, RawDoc, iter_raw_docs
from tests.helpers import run_entry_point

ENCODED: list[str] = []  # every text the test-only format encoded


def encode_upper(encoder, docs):
    """The test-only format's encoding: the text encoding of each document upper-cased."""
    ENCODED.extend(d.payload.upper() for d in docs)
    return encode_texts(encoder, [RawDoc(d.where, d.payload.upper()) for d in docs])


UPPER = DataFormat(
    "flexengine.data.sources:check_text_record", f"{__name__}:encode_upper", "data.text_field", texts=True
)


@pytest.fixture
def upper(monkeypatch):
    """FORMATS with the test-only format as one more entry, and nothing else changed."""
    monkeypatch.setitem(FORMATS, "upper", UPPER)
    ENCODED.clear()
    return "upper"


def _texts(n: int = 40) -> list[str]:
    """Mixed-case source texts of a few hundred characters each (the standard library's)."""
    sources = sorted(Path(os.__file__).parent.glob("*.py"))[:n]
    return [p.read_text(errors="replace")[: 300 + 97 * (i % 9)] for i, p in enumerate(sources)]


def test_the_shipped_formats_and_the_columns_they_read():
    assert list(FORMATS) == ["text", "chat", "pretokenized", "mixed"]  # the order the choices are listed in
    data = DataConfig(text_field="body", messages_field="turns", format_field="kind")
    assert {name: f.columns(data) for name, f in FORMATS.items()} == {
        "text": ["body"],
        "chat": ["turns"],
        "pretokenized": ["input_ids", "labels"],
        "mixed": ["kind", "body", "turns"],
    }
    assert data_format("pretokenized").needed(data) == ("input_ids", None)  # a fixed name, no key
    assert data_format("chat").needed(data) == ("turns", "data.messages_field")
    assert [n for n, f in FORMATS.items() if f.has_mask] == ["chat", "pretokenized", "mixed"]
    assert [n for n, f in FORMATS.items() if f.chats] == ["chat", "mixed"]
    assert [n for n, f in FORMATS.items() if f.texts] == ["text", "mixed"]


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_names_a_check_and_an_encoding_that_exist(name):
    assert callable(function_named(FORMATS[name].check)) and callable(function_named(FORMATS[name].encode))


def test_an_unknown_format_is_refused_listing_the_table():
    with pytest.raises(UserError, match=r"data.format='xml' is not valid; choose one of text, chat, pretokenized"):
        data_format("xml")
    with pytest.raises(UserError, match=r"data.format='upper' is not valid; choose one of text, chat, pretokenized"):
        compose_job(["data.format=upper"])  # not in the table (the fixture's entry is gone after its test)


def test_a_new_format_is_one_entry_that_composes_and_is_read_through_its_check(upper, tmp_path):
    texts = _texts(4)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + json.dumps({"text": ""}) + "\n")
    pq.write_table(pa.table({"text": texts, "id": list(range(4))}), tmp_path / "d.parquet")
    assert compose_job([f"data.format={upper}"]).data.format == upper  # the demo corpus's text records too
    for source, path, where in (("jsonl", jsonl, f"{jsonl}:5"), ("parquet", tmp_path / "d.parquet", None)):
        data = DataConfig(source=source, path=str(path), format=upper, on_error="skip")
        bad = BadRecords("skip")
        assert [d.payload for d in iter_raw_docs(data, bad)] == texts  # only its column, in file order
        assert bad.counts == ({"empty_document": 1} if where else {})  # the text format's check, which it names
    with pytest.raises(UserError, match=f"{jsonl}:5: 'text' is empty"):
        list(iter_raw_docs(DataConfig(source="jsonl", path=str(jsonl), format=upper), BadRecords()))


def test_a_new_format_encodes_through_its_own_function(upper, tmp_path):
    demo_tokenizer = load_demo_tokenizer()
    texts = _texts(6)
    for name, rows in (("mixed-case", texts), ("upper-case", [t.upper() for t in texts])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    common = dict(source="jsonl", cache_dir=str(tmp_path / "cache"), num_workers=0)
    ours = build_corpus(DataConfig(path=str(tmp_path / "mixed-case.jsonl"), format=upper, **common), demo_tokenizer)
    text = build_corpus(DataConfig(path=str(tmp_path / "upper-case.jsonl"), **common), demo_tokenizer)
    assert [t.upper() for t in texts] == ENCODED
    assert (ours.tokens == text.tokens).all() and (ours.offsets == text.offsets).all()
    assert ours.loss_mask is None  # has_mask=False: every token is trained on
    assert ours.cache_path != text.cache_path  # data.format is part of the cache key


def test_a_new_format_trains_two_steps_through_flexengine_train(upper, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts()))
    run_dir = tmp_path / "run"
    code, stderr = run_entry_point(
        [
            "debug=fast",
            "data=jsonl",
            f"data.path={data}",
            f"data.format={upper}",  # after data=jsonl, which would reset it
            "data.seq_len=256",
            "data.num_workers=0",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.max_steps=2",
            "train.save_final=false",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert code == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and all(math.isfinite(loss) for loss in summary["losses"])
    assert summary["config"]["data"]["format"] == upper and summary["data"]["documents"] == 40
    assert len(ENCODED) == 40 and all(t == t.upper() for t in ENCODED)
