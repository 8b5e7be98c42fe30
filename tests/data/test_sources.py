"""Reading records: file:line errors for every kind of bad record, skip counts, Parquet, paths, max_docs."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flexengine.core.config import DataConfig
from flexengine.core.errors import UserError
from flexengine.data.sources import BadRecords, check_chat_messages, iter_raw_docs, resolve_paths
from tests.helpers import hide_package

GOOD = json.dumps({"text": "print('hello')"})

# (planted line, reason counted under on_error=skip, words the raise message must contain)
BAD_TEXT_LINES = [
    ("{not json", "malformed_json", "not valid JSON"),
    (json.dumps({"body": "x"}), "missing_field", "no 'text' field"),
    (json.dumps({"text": 42}), "not_a_string", "'text' is int"),
    (json.dumps({"text": None}), "null_field", "'text' is null"),  # before: "no 'text' field"
    (json.dumps({"text": "   \n"}), "empty_document", "'text' is empty"),
    (json.dumps(["text"]), "not_an_object", "record is list"),
]


def _read(data: DataConfig) -> tuple[list, dict]:
    bad = BadRecords(data.on_error)
    return list(iter_raw_docs(data, bad)), bad.counts


@pytest.mark.parametrize("line, reason, words", BAD_TEXT_LINES, ids=[r for _, r, _ in BAD_TEXT_LINES])
def test_bad_text_record_raises_with_file_and_line(tmp_path, write_lines, line, reason, words):
    path = write_lines(tmp_path / "d.jsonl", [GOOD, "", GOOD, line, GOOD])  # blank line 2 still counts
    with pytest.raises(UserError) as err:
        _read(DataConfig(source="jsonl", path=str(path)))
    assert f"{path}:4: " in str(err.value) and words in str(err.value) and "data.on_error=skip" in str(err.value)


def test_skip_counts_every_bad_record_by_reason(tmp_path, write_lines):
    lines = [GOOD] + [line for line, _, _ in BAD_TEXT_LINES] * 2 + [GOOD]
    path = write_lines(tmp_path / "d.jsonl", lines)
    docs, counts = _read(DataConfig(source="jsonl", path=str(path), on_error="skip"))
    assert len(docs) == 2
    assert counts == {reason: 2 for _, reason, _ in BAD_TEXT_LINES}


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"messages": []}, "bad_messages"),
        ({"messages": [{"role": "user"}]}, "bad_messages"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
        ({"conversation": []}, "missing_field"),
        ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "unknown_role"),
    ],
)
def test_bad_chat_records(tmp_path, write_jsonl, record, reason):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [good, record])
    docs, counts = _read(DataConfig(source="jsonl", path=str(path), format="chat", on_error="skip"))
    assert [d.where for d in docs] == [f"{path}:1"] and counts == {reason: 1}
    with pytest.raises(UserError, match=f"{path}:2: "):
        _read(DataConfig(source="jsonl", path=str(path), format="chat"))


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"input_ids": []}, "bad_token_ids"),
        ({"input_ids": [1, "2"]}, "bad_token_ids"),
        ({"input_ids": [1, 2], "labels": [1]}, "bad_labels"),
        ({"input_ids": [1, 2], "labels": [1, 3]}, "bad_labels"),
    ],
)
def test_bad_pretokenized_records(tmp_path, write_jsonl, record, reason):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [1, 2], "labels": [-100, 2]}, record])
    docs, counts = _read(DataConfig(source="jsonl", path=str(path), format="pretokenized", on_error="skip"))
    assert docs[0].payload == ([1, 2], [-100, 2]) and counts == {reason: 1}


def test_parquet_text_and_row_location(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a = 1", None, "b = 2", ""]}), path)
    docs, counts = _read(DataConfig(source="parquet", path=str(path), on_error="skip"))
    assert [d.payload for d in docs] == ["a = 1", "b = 2"] and counts == {"null_field": 1, "empty_document": 1}
    assert docs[1].where == f"{path}:row 2"
    with pytest.raises(UserError, match=f"{path}:row 1: 'text' is null"):
        _read(DataConfig(source="parquet", path=str(path)))


def test_parquet_chat_and_pretokenized(tmp_path):
    chat = tmp_path / "chat.parquet"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    pq.write_table(pa.table({"messages": [turns], "other": [1]}), chat)
    docs, _ = _read(DataConfig(source="parquet", path=str(chat), format="chat"))
    assert docs[0].payload == turns
    tokens = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4]], "labels": [[-100, 2, 3], None]}), tokens)
    docs, _ = _read(DataConfig(source="parquet", path=str(tokens), format="pretokenized"))
    assert [d.payload for d in docs] == [([1, 2, 3], [-100, 2, 3]), ([4], None)]


def test_paths_globs_directories_and_max_docs(tmp_path, write_jsonl):
    for name in ("b.jsonl", "a.jsonl"):
        write_jsonl(tmp_path / name, [{"text": f"{name} {i}"} for i in range(3)])
    (tmp_path / "README.md").write_text("not data")
    assert [p.name for p in resolve_paths(str(tmp_path))] == ["a.jsonl", "b.jsonl"]  # sorted, README ignored
    assert [p.name for p in resolve_paths(f"{tmp_path}/b.jsonl, {tmp_path}/a*")] == ["b.jsonl", "a.jsonl"]
    docs, _ = _read(DataConfig(source="jsonl", path=str(tmp_path), max_docs=4))
    assert [d.payload for d in docs] == ["a.jsonl 0", "a.jsonl 1", "a.jsonl 2", "b.jsonl 0"]
    with pytest.raises(UserError, match="matches no jsonl file"):
        resolve_paths(f"{tmp_path}/missing*.jsonl")


def test_mixed_file_reads_text_and_chat_records_by_their_field(tmp_path, write_jsonl):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"format": "text", "text": "print(1)"},
            {"format": "chat", "messages": chat},
            {"format": "audio", "text": "?"},
        ],
    )
    docs, counts = _read(DataConfig(source="jsonl", path=str(path), format="mixed", on_error="skip"))
    assert [d.payload for d in docs] == [("text", "print(1)"), ("chat", chat)]
    assert counts == {"bad_format_field": 1}
    with pytest.raises(UserError, match=r"m\.jsonl:3: format='audio'"):
        _read(DataConfig(source="jsonl", path=str(path), format="mixed"))


def test_unknown_chat_role_names_the_role_and_the_line(tmp_path, write_jsonl):
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "wizard", "content": "abracadabra"},
        {"role": "assistant", "content": "yo"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": turns}])
    with pytest.raises(UserError, match=f"{path}:1: messages\\[1\\].role='wizard' is not a chat role"):
        _read(DataConfig(source="jsonl", path=str(path), format="chat"))
    assert check_chat_messages(turns[::2]) == (None, "")  # the helper other readers reuse


# invalid UTF-8 (a Latin-1 byte after a valid two-byte "é") and binary junk (NUL, 0xff) on lines 2 and 4 of five
UNDECODABLE = [
    GOOD.encode(),
    '{"text": "é café'.encode() + b'\xe9"}',
    GOOD.encode(),
    b"\x00\xff\xfe binary \x89PNG",
    GOOD.encode(),
]


def test_invalid_utf8_is_a_bad_record_with_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(UNDECODABLE) + b"\n")
    with pytest.raises(UserError) as err:
        _read(DataConfig(source="jsonl", path=str(path)))
    # the column counts characters (before: the byte offset + 1, 19 here)
    assert f"{path}:2: not valid UTF-8 (byte 0xe9 at column 17)" in str(err.value)
    docs, counts = _read(DataConfig(source="jsonl", path=str(path), on_error="skip"))
    assert [d.where for d in docs] == [f"{path}:1", f"{path}:3", f"{path}:5"]
    assert counts == {"invalid_utf8": 2}


def test_utf8_bom_and_crlf_are_layout(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n" + GOOD.encode() + b"\r\n")
    docs, counts = _read(DataConfig(source="jsonl", path=str(path)))
    assert len(docs) == 2 and counts == {}


def test_a_record_over_max_record_bytes_is_a_bad_record_read_no_further(tmp_path):
    """Before: a 200 MB single-line JSONL was read and tokenized whole (4.6 GiB RSS after minutes, no bound)."""
    huge = json.dumps({"text": "x" * 5000})
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([GOOD, huge, GOOD, huge]))  # the last line has no newline: bounded too
    with pytest.raises(UserError) as err:
        _read(DataConfig(source="jsonl", path=str(path), max_record_bytes=1000))
    assert f"{path}:2: a record longer than data.max_record_bytes=1000 bytes" in str(err.value)
    docs, counts = _read(DataConfig(source="jsonl", path=str(path), max_record_bytes=1000, on_error="skip"))
    assert [d.where for d in docs] == [f"{path}:1", f"{path}:3"] and counts == {"record_too_large": 2}
    docs, _ = _read(DataConfig(source="jsonl", path=str(path), max_record_bytes=len(huge)))  # a line fits exactly
    assert len(docs) == 4


def test_max_record_bytes_must_be_positive():
    with pytest.raises(UserError, match="data.max_record_bytes=0 must be a positive"):
        DataConfig(max_record_bytes=0)


def test_parquet_mixed_reads_each_kinds_column(tmp_path):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"format": ["text", "chat"], "text": ["print(1)", None], "messages": [None, turns]}), path)
    docs, counts = _read(DataConfig(source="parquet", path=str(path), format="mixed"))
    assert [d.payload for d in docs] == [("text", "print(1)"), ("chat", turns)] and counts == {}


def test_an_unreadable_parquet_file_is_named_with_what_to_do(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match=rf"{path}: cannot read as Parquet \(\w+: .*\)\. Replace the file, or leave it"):
        _read(DataConfig(source="parquet", path=str(path)))


def test_parquet_without_pyarrow_names_the_source_and_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a = 1"]}), path)
    hide_package(monkeypatch, "pyarrow")
    with pytest.raises(UserError, match=r"data\.source=parquet needs the `pyarrow` package.*flexengine\[parquet\]"):
        _read(DataConfig(source="parquet", path=str(path)))
