"""The record formats `data.format` picks, one `DataFormat` each: the columns a record of it holds, how one record is
checked, how checked records become tokens, and what follows from them (a loss mask, a document separator, a chat
template). `FORMATS` is the only list: composition checks data.format against it, data/sources.py checks records
with it, data/encode.py encodes with it, data/cache.py keys the tokenized corpus on it.

A format names its record check and its encoder (`module:function`) rather than importing them: this module sits in
core, below data/ that holds them, and composing a job must load no tokenizer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from flexengine.core.errors import UserError

# the data.* a format reads its column names from: a core/config_data.DataConfig (which imports this table)
DataConfig = Any

# the data.* options a chat encoding's tokens depend on (format_field with them: a mixed record names its kind there)
CHAT_OPTIONS = ("format_field", "train_on", "assistant_mask", "long_chats", "seq_len")


@dataclass(frozen=True)
class DataFormat:
    """One data.format. A column is spelled as the data.* key that names it ("data.text_field") or, where no key
    does, as the column's own name ("input_ids")."""

    check: str  # "module:function": (record: dict, data) -> (reason or None when good, message, payload to encode)
    encode: str  # "module:function": (encoder, docs: list of RawDoc) -> one Encoded, Rejected or Dropped per doc
    needs: str  # the column every record holds: a table (Parquet, HF dataset) without it is a config error
    reads: tuple[str, ...] = ()  # the other columns it reads, where a record has them
    has_mask: bool = False  # some tokens may carry no loss (chat prompts, labels of -100): the corpus keeps a mask
    texts: bool = False  # holds plain-text documents, each ended by the document separator (data.add_eos)
    # holds conversations, rendered by the tokenizer's chat template (which it needs) and fitted to data.seq_len
    # (data.long_chats), so their length is not known before the row length is
    chats: bool = False
    options: tuple[str, ...] = ()  # data.* keys its tokens depend on besides the ones every format's do

    def needed(self, data: DataConfig) -> tuple[str, Optional[str]]:
        """(the column every record holds, the data.* key naming it, or None where its name is fixed)."""
        return _column(self.needs, data)

    def columns(self, data: DataConfig) -> list[str]:
        """Every column it reads, the needed one first."""
        return list(dict.fromkeys(_column(c, data)[0] for c in (self.needs, *self.reads)))


def _column(spelling: str, data: DataConfig) -> tuple[str, Optional[str]]:
    if spelling.startswith("data."):
        return getattr(data, spelling[len("data.") :]), spelling
    return spelling, None


_CHECKS = "flexengine.data.sources:"  # where the shipped record checks live
_ENCODINGS = "flexengine.data.encode:"  # where the shipped encodings live
FORMATS: dict[str, DataFormat] = {
    # one document per record, its text in data.text_field
    "text": DataFormat(_CHECKS + "check_text_record", _ENCODINGS + "encode_texts", "data.text_field", texts=True),
    # one conversation per record, in data.messages_field; with data.train_on=assistant only the replies carry loss
    "chat": DataFormat(
        _CHECKS + "check_chat_record",
        _ENCODINGS + "encode_chats",
        "data.messages_field",
        has_mask=True,
        chats=True,
        options=CHAT_OPTIONS,
    ),
    # token ids as given; labels of -100 (where a record has labels) mark the tokens not trained on
    "pretokenized": DataFormat(
        _CHECKS + "check_token_record",
        _ENCODINGS + "encode_pretokenized",
        "input_ids",
        reads=("labels",),
        has_mask=True,
    ),
    # text and chat records, each naming which it is in data.format_field
    "mixed": DataFormat(
        _CHECKS + "check_mixed_record",
        _ENCODINGS + "encode_mixed",
        "data.format_field",
        reads=("data.text_field", "data.messages_field"),
        has_mask=True,
        texts=True,
        chats=True,
        options=CHAT_OPTIONS,
    ),
}


def data_format(name: str) -> DataFormat:
    """The format data.format names, or a UserError listing the formats there are."""
    if name not in FORMATS:
        raise UserError(f"data.format={name!r} is not valid; choose one of {', '.join(FORMATS)}.")
    return FORMATS[name]


def function_named(reference: str) -> Callable[..., Any]:
    """The function a "module:function" reference names (its module imported on first use)."""
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)
