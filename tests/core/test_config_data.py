"""The data.* schema (flexengine/core/config_data.py): DataConfig refuses combinations that cannot be read, naming the
key, fills each mixture source from data.*, and answers which formats are read and whether a held-out set exists."""

from __future__ import annotations

import pytest

from flexengine.core.config_data import DataConfig, MixSource
from flexengine.core.errors import UserError


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(source="csv"), "data.source='csv' is not valid"),
        (dict(source="jsonl"), "data=jsonl needs data.path"),
        (dict(seq_len=0), "data.seq_len=0 must be a positive number of tokens"),
        (dict(max_record_bytes=0), "data.max_record_bytes=0 must be a positive"),
        (dict(max_docs=0), "data.max_docs=0 must be positive"),
        (dict(num_workers=-1), "data.num_workers=-1 must be >= 0"),
        (dict(format="chat"), "data=demo is plain text; data.format=chat needs data=jsonl"),
        (dict(eval_fraction=1.0), r"data.eval_fraction=1.0 must be in \[0, 1\)"),
        (dict(source="jsonl", path="a", eval_path="b", eval_fraction=0.1), "data.eval_path and data.eval_fraction"),
        (dict(source="jsonl", path="a", eval_split="test"), "data.eval_split=test names a split of data.eval_path"),
        (dict(eval_path="b"), "data.eval_path needs a file source"),
        (dict(eval_overlap="keep"), "data.eval_overlap='keep' is not valid"),
        (dict(train_on="user"), "data.train_on='user' is not valid"),
    ],
)
def test_bad_data_settings_are_refused_naming_the_key(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        DataConfig(**kwargs)


def test_mixture_sources_inherit_data_source_and_format_unless_they_name_their_own():
    data = DataConfig(
        source="jsonl",
        format="text",
        mix=[MixSource(path="code.jsonl"), MixSource(path="chats.parquet", source="parquet", format="chat")],
    )
    assert [(m.source, m.format) for m in data.mix] == [("jsonl", "text"), ("parquet", "chat")]
    assert data.formats == {"text", "chat"}
    assert DataConfig().formats == {"text"}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(source="jsonl", path="a.jsonl", mix=[MixSource(path="b")]), "data.path and data.mix are both set"),
        (dict(mix=[MixSource(path="b")]), r"data.mix\[0\].source='demo' is not valid"),  # demo cannot be mixed
        (dict(source="jsonl", mix=[MixSource(path="b"), MixSource()]), r"data.mix\[1\] has no path"),
        (dict(source="jsonl", mix=[MixSource(path="b", weight=0)]), r"data.mix\[0\].weight=0 must be positive"),
        (dict(source="jsonl", mix=[MixSource(path="b", format="xml")]), r"data.mix\[0\].format='xml'"),
    ],
)
def test_bad_mixtures_are_refused_naming_the_entry(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        DataConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "has_eval"),
    [
        (dict(), False),
        (dict(eval_fraction=0.1), True),
        (dict(source="jsonl", path="a", eval_path="b"), True),
        (dict(source="jsonl", path="a", eval_path="b", eval_split="validation"), True),
    ],
)
def test_a_held_out_set_comes_from_a_fraction_or_a_file(kwargs, has_eval):
    assert DataConfig(**kwargs).has_eval is has_eval


@pytest.mark.parametrize("fmt", ["chat", "mixed"])
def test_auto_row_length_is_refused_over_conversations(fmt):
    """A chat's tokens depend on the row length (data.long_chats), so data.seq_len=auto is refused there, by name;
    text keeps it."""
    with pytest.raises(UserError, match=f"data.seq_len=auto with data.format={fmt}"):
        DataConfig(source="jsonl", path="chats.jsonl", format=fmt, seq_len="auto")
    assert DataConfig(source="jsonl", path="docs.jsonl", format="text", seq_len="auto").fixed_seq_len is None
