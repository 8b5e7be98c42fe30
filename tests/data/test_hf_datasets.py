"""source=hf: local files through `datasets.load_dataset`, save_to_disk directories through load_from_disk,
records equal to the plain JSONL reader's, and no network access at any point."""

from __future__ import annotations

import json
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flexengine.core.config import DataConfig
from flexengine.core.errors import UserError
from flexengine.data.sources import BadRecords, iter_raw_docs
from tests.helpers import hide_package

TEXTS = [f"def f{i}(x):\n    return x * {i}\n" for i in range(12)]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt fails the test: local data must never reach for the hub."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _texts(data: DataConfig) -> list[str]:
    return [doc.payload for doc in iter_raw_docs(data, BadRecords(data.on_error))]


def test_json_parquet_and_saved_dataset_read_the_same_documents(tmp_path):
    import datasets

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "b.parquet")
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": TEXTS[:3]}),
            "test": datasets.Dataset.from_dict({"text": TEXTS[3:5]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    cache = str(tmp_path / "cache")
    reference = _texts(DataConfig(source="jsonl", path=str(jsonl)))
    assert reference == TEXTS
    assert _texts(DataConfig(source="hf", path=str(jsonl), cache_dir=cache)) == TEXTS
    assert _texts(DataConfig(source="hf", path=str(tmp_path / "b.parquet"), cache_dir=cache)) == TEXTS
    assert _texts(DataConfig(source="hf", path=str(tmp_path / "saved"), cache_dir=cache)) == TEXTS
    assert _texts(DataConfig(source="hf", path=str(tmp_path / "dd"), hf_split="test", cache_dir=cache)) == TEXTS[3:5]
    with pytest.raises(UserError, match="no split 'validation'.*train, test"):
        _texts(DataConfig(source="hf", path=str(tmp_path / "dd"), hf_split="validation", cache_dir=cache))


def test_bad_hf_record_names_file_and_row(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["ok", "", "fine"]}), path)
    with pytest.raises(UserError, match=r"c\.parquet:row 1: 'text' is empty"):
        _texts(DataConfig(source="hf", path=str(path), cache_dir=str(tmp_path / "cache")))


def test_hf_source_trains_end_to_end_from_a_saved_dataset(tmp_path):
    import datasets

    from flexengine.cli.common import compose_job
    from flexengine.run import run_training

    rows = {"text": [t * 20 for t in TEXTS * 4]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    job = compose_job(
        [
            "debug=fast",
            "data=hf",
            f"data.path={tmp_path / 'saved'}",
            "data.seq_len=128",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.num_workers=0",
            "train.max_steps=2",
            "train.save_final=false",
            f"train.output_dir={tmp_path / 'run'}",
        ]
    )
    summary = run_training(job, tmp_path / "run")
    assert summary["steps"] == 2 and summary["data"]["documents"] == 48


@pytest.mark.parametrize("kind", ["parquet", "saved", "hf_parquet"])
def test_wrong_column_lists_the_columns_and_names_the_key(tmp_path, kind):
    """A text_field that is no column is a config error naming data.text_field and the columns, for every row at
    once, never a per-record error suggesting data.on_error=skip (which would skip every row)."""
    import datasets

    if kind == "saved":
        datasets.Dataset.from_dict({"content": TEXTS, "id": list(range(12))}).save_to_disk(str(tmp_path / "d"))
        path, source = tmp_path / "d", "hf"
    else:
        path = tmp_path / "a.parquet"
        pq.write_table(pa.table({"content": TEXTS, "id": list(range(12))}), path)
        source = "parquet" if kind == "parquet" else "hf"
    data = DataConfig(source=source, path=str(path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError) as info:
        _texts(data)
    message = str(info.value)
    assert "data.text_field" in message and "'content'" in message and "'id'" in message
    assert "on_error" not in message
    with pytest.raises(UserError, match="data.text_field"):  # skip cannot turn a wrong column into zero documents
        _texts(DataConfig(source=source, path=str(path), cache_dir=str(tmp_path / "cache"), on_error="skip"))


def test_a_saved_split_names_the_dataset_and_split_of_a_bad_row_and_of_a_missing_column(tmp_path):
    import datasets

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    splits = {"train": {"text": ["fine", "   "]}, "test": {"messages": [turns, turns]}}
    datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "dd")
    )
    data = dict(source="hf", path=str(tmp_path / "dd"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match=rf"bad record at {tmp_path / 'dd'}\[train\]:row 1: 'text' is empty. Fix"):
        _texts(DataConfig(**data))
    with pytest.raises(UserError, match=rf"{tmp_path / 'dd'}\[test\]: no column 'text' \(data.text_field\)"):
        _texts(DataConfig(**data, hf_split="test"))
    # the turns as the JSONL and Parquet readers give them: a list of {role, content}
    docs = list(iter_raw_docs(DataConfig(**data, hf_split="test", format="chat"), BadRecords()))
    assert [d.payload for d in docs] == [turns, turns] and docs[1].where == f"{tmp_path / 'dd'}[test]:row 1"


def test_without_datasets_the_source_names_the_extra(tmp_path, monkeypatch):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    hide_package(monkeypatch, "datasets")
    with pytest.raises(UserError, match=r"data\.source=hf needs the `datasets` package.*flexengine\[hf\]', or read"):
        _texts(DataConfig(source="hf", path=str(jsonl), cache_dir=str(tmp_path / "cache")))
