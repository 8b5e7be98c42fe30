"""Read raw documents from the demo corpus, JSON Lines or Parquet, checking each record where it is read.

Every record becomes a `RawDoc(where, payload)`: `where` is "file:line" (JSONL) or "file:row N" (Parquet, 0-based),
so any later error can name it. A bad record goes through `BadRecords.report`: with data.on_error=raise it
stops the run with the location; with skip it is counted under its reason. Nothing is dropped without a count.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

from flexengine.core.config import DataConfig
from flexengine.core.errors import UserError
from flexengine.core.extras import require
from flexengine.data.demo import demo_source_files

# Directory entries read for each source (explicit files and globs are read whatever their suffix).
SUFFIXES = {
    "jsonl": (".jsonl", ".json", ".ndjson"),
    "parquet": (".parquet", ".pq"),
    "hf": (".jsonl", ".json", ".ndjson", ".parquet", ".pq", ".arrow"),
}
# the `datasets` builder that reads each suffix (source=hf)
HF_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
}
PARQUET_BATCH_ROWS = 1024
# one record as a reader yields it: (where, the record as parsed, why it could not be parsed, that reason's name)
ParsedRecord = tuple[str, Any, Optional[str], str]
# Roles chat templates know (OpenAI/HF: system, user, assistant, tool; older or model-specific: developer,
# function, ipython). Anything else is a typo or a foreign schema that a template would render silently.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


class RawDoc(NamedTuple):
    """One checked record: text (format=text), messages (chat) or (input_ids, labels|None) (pretokenized)."""

    where: str
    payload: Any


@dataclass
class BadRecords:
    """Applies data.on_error to bad records and keeps the per-reason counts."""

    on_error: str = "raise"
    counts: dict = field(default_factory=dict)  # reason -> records skipped

    def report(self, reason: str, message: str) -> None:
        """Raise (on_error=raise) or count (skip) one bad record; message starts with its location."""
        if self.on_error == "raise":
            raise UserError(
                f"bad record at {message}. Fix the record, or set data.on_error=skip to skip and count such records."
            )
        self.counts[reason] = self.counts.get(reason, 0) + 1


def resolve_paths(spec: str, source: str = "jsonl") -> list[Path]:
    """Comma-separated files, directories or globs -> existing files in order; an error names what matched nothing."""
    paths: list[Path] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        matches = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
        found: list[Path] = []
        for m in map(Path, matches):
            if m.is_dir():
                found.extend(sorted(q for q in m.iterdir() if q.is_file() and q.suffix in SUFFIXES[source]))
            elif m.is_file():
                found.append(m)
        if not found:
            raise UserError(
                f"data.path: {part!r} matches no {source} file. Give a file, a directory (files ending in "
                f"{', '.join(SUFFIXES[source])}) or a glob."
            )
        paths.extend(found)
    return paths


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


EVAL_SPLITS = ("validation", "test")  # data.eval_split's default, in order of preference


def saved_splits(path: Path) -> Optional[list[str]]:
    """The split names of a save_to_disk DatasetDict directory (from its dataset_dict.json); None if it is not one."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        return None
    return list(json.loads(index.read_text(encoding="utf-8"))["splits"])


def resolve_eval_split(data: DataConfig) -> Optional[str]:
    """The split of data.eval_path evaluated on: data.eval_split, else validation, else test; None when
    data.eval_path is not a saved DatasetDict (it has no splits). Never the training split by default."""
    path = Path(data.eval_path or "")
    splits = saved_splits(path) if data.source == "hf" else None
    if splits is None:
        if data.eval_split:
            raise UserError(
                f"data.eval_split={data.eval_split}: data.eval_path={path} is not a saved DatasetDict (data=hf, a "
                "save_to_disk directory with dataset_dict.json), so it has no splits; remove data.eval_split."
            )
        return None
    if data.eval_split:
        if data.eval_split not in splits:
            raise UserError(
                f"data.eval_split={data.eval_split}: data.eval_path={path} has no such split; it has "
                f"{', '.join(splits)}."
            )
        return data.eval_split
    for name in EVAL_SPLITS:
        if name in splits:
            return name
    raise UserError(
        f"data.eval_path={path} has no {' or '.join(EVAL_SPLITS)} split (it has {', '.join(splits)}): name the "
        f"held-out one with data.eval_split=<split>."
    )


def unused_eval_split(data: DataConfig) -> Optional[str]:
    """The held-out split (validation, else test) of a DatasetDict data.path when no held-out set is configured."""
    splits = saved_splits(Path(data.path or "")) if data.source == "hf" and not data.has_eval else None
    return next((name for name in EVAL_SPLITS if name in (splits or [])), None)


def source_files(data: DataConfig) -> list[Path]:
    """The files the configured source reads, in reading order (also what the tokenized cache is keyed on)."""
    if data.source == "demo":
        return demo_source_files(data.demo_max_files)
    saved = Path(data.path or "")
    if data.source == "hf" and is_saved_dataset(saved):
        return sorted(p for p in saved.rglob("*") if p.is_file())
    return resolve_paths(data.path or "", data.source)


def _import_datasets():
    """`datasets`, offline: local files and saved datasets need no hub, so none is ever contacted."""
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    datasets = require("datasets", "data.source=hf", "read the files directly with data=jsonl / data=parquet")
    datasets.config.HF_DATASETS_OFFLINE = True  # also when it was imported before the variables were set
    datasets.config.HF_HUB_OFFLINE = True
    return datasets


def needed_column(data: DataConfig) -> tuple[str, Optional[str]]:
    """(the record field every record of data.format needs, the config key that names it, if one does)."""
    if data.format == "text":
        return data.text_field, "data.text_field"
    if data.format == "chat":
        return data.messages_field, "data.messages_field"
    if data.format == "mixed":
        return data.format_field, "data.format_field"  # its text/messages fields are needed per record
    return "input_ids", None  # pretokenized: fixed names


def check_columns(path: Path, columns: list[str], data: DataConfig) -> None:
    """A column data.format needs that a table (Parquet, HF dataset) lacks is a config error, not a bad record:
    every row would fail, and data.on_error=skip would skip them all. Name the key and the columns there are."""
    name, key = needed_column(data)
    if name in columns:
        return
    fix = (
        f"Set {key} to the column holding them, e.g. {key}={columns[0]}"
        if key and columns
        else f"data.format={data.format} needs that column"
    )
    raise UserError(
        f"{path}: no column {name!r} ({key or 'data.format=' + data.format}); its columns are "
        f"{', '.join(map(repr, columns)) or 'none'}. {fix}."
    )


def _iter_hf(path: Path, data: DataConfig) -> Iterator[ParsedRecord]:
    """Rows of a save_to_disk directory or of one local data file, through HF `datasets`."""
    datasets = _import_datasets()
    try:
        if is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if data.hf_split not in ds:
                    raise UserError(
                        f"data.path={path}: no split {data.hf_split!r} (data.hf_split); it has {', '.join(ds)}."
                    )
                ds = ds[data.hf_split]
        else:
            from flexengine.data.cache import corpus_cache_dir

            ds = datasets.load_dataset(
                HF_BUILDERS[path.suffix],
                data_files=str(path),
                split="train",
                cache_dir=str(corpus_cache_dir(data.cache_dir).parent / "hf-datasets"),
            )
    except UserError:
        raise
    except Exception as e:  # datasets/pyarrow raise many types for unreadable files
        raise UserError(
            f"{path}: cannot load with HF datasets ({type(e).__name__}: {e}). For line-by-line checks "
            "with file:line use data=jsonl."
        ) from None
    check_columns(path, list(ds.column_names), data)
    for row, record in enumerate(ds):
        yield f"{path}:row {row}", record, None, ""


def _units(data: DataConfig, files: list[Path]) -> list[Path]:
    """What iter_raw_docs opens one by one: the files, or the saved dataset directory as one unit."""
    saved = Path(data.path or "")
    if data.source == "hf" and is_saved_dataset(saved):
        return [saved]
    return files


def _check_text(value: Any, name: str) -> tuple[Optional[str], str]:
    if value is None:
        return "missing_field", f"no {name!r} field (data.text_field)"
    if not isinstance(value, str):
        return "not_a_string", f"{name!r} is {type(value).__name__}, not a string"
    if not value.strip():
        return "empty_document", f"{name!r} is empty"
    return None, ""


def check_chat_messages(value: Any, name: str = "messages") -> tuple[Optional[str], str]:
    """(reason, message) for a chat conversation: None if it is a non-empty list of {role, content} turns with
    known roles (CHAT_ROLES) and at least one assistant turn, else why not (the caller adds file:line)."""
    if value is None:
        return "missing_field", f"no {name!r} field (data.messages_field)"
    if not isinstance(value, list) or not value:
        return "bad_messages", f"{name!r} must be a non-empty list of {{'role': ..., 'content': ...}} turns"
    for i, turn in enumerate(value):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            return "bad_messages", f"{name}[{i}] must be an object with string 'role' and 'content'"
        if turn["role"] not in CHAT_ROLES:
            return "unknown_role", f"{name}[{i}].role={turn['role']!r} is not a chat role ({', '.join(CHAT_ROLES)})"
    if not any(turn["role"] == "assistant" for turn in value):
        return "no_assistant_turn", f"{name!r} has no assistant turn, so nothing in it would be trained on"
    return None, ""


def _check_token_ids(record: dict) -> tuple[Optional[str], str]:
    ids = record.get("input_ids")
    if ids is None:
        return "missing_field", "no 'input_ids' field"
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return "bad_token_ids", "'input_ids' must be a non-empty list of integers"
    labels = record.get("labels")
    if labels is None:
        return None, ""
    if not isinstance(labels, list) or len(labels) != len(ids):
        return "bad_labels", f"'labels' must be a list as long as 'input_ids' ({len(ids)})"
    # Packed rows take labels from input_ids, so only "train on this token" (= input id) or -100 can be kept.
    for i, (t, label) in enumerate(zip(ids, labels)):
        if label != t and label != -100:
            return "bad_labels", f"labels[{i}]={label!r} is neither input_ids[{i}]={t} nor -100"
    return None, ""


def _needed_fields(data: DataConfig, record: dict) -> tuple[str, ...]:
    """The fields data.format reads from this record (a null in one of them is named as a null, not as absent)."""
    if data.format == "text":
        return (data.text_field,)
    if data.format == "chat":
        return (data.messages_field,)
    if data.format == "mixed":
        kind = record.get(data.format_field)
        return (
            data.format_field,
            {"text": data.text_field, "chat": data.messages_field}.get(str(kind), data.format_field),
        )
    return ("input_ids",)


_FORMAT_HINT = "Set data.format={fmt} (in a data.mix, format: {fmt} on that source)"


def check_record(record: Any, data: DataConfig) -> tuple[Optional[str], str, Any]:
    """(reason, message, payload) for one parsed record: reason None means good and payload is what to encode."""
    if not isinstance(record, dict):
        return "not_an_object", f"record is {type(record).__name__}, not an object", None
    for name in _needed_fields(data, record):
        if name in record and record[name] is None:  # present, but null: not the "no such field" below
            return "null_field", f"{name!r} is null (JSON null): the field is there, without a value", None
    if data.format == "text":
        value = record.get(data.text_field)
        reason, message = _check_text(value, data.text_field)
        if reason == "missing_field" and data.messages_field in record:
            message += f"; it has {data.messages_field!r}: a chat record? {_FORMAT_HINT.format(fmt='chat')}"
        return reason, message, value
    if data.format == "chat":
        value = record.get(data.messages_field)
        reason, message = check_chat_messages(value, data.messages_field)
        if reason == "missing_field" and data.text_field in record:
            message += f"; it has {data.text_field!r}: a text record? {_FORMAT_HINT.format(fmt='text')}"
        return reason, message, value
    if data.format == "mixed":  # the record says which it is
        kind = record.get(data.format_field)
        if kind == "text":
            value = record.get(data.text_field)
            return (*_check_text(value, data.text_field), (kind, value))
        if kind == "chat":
            value = record.get(data.messages_field)
            return (*check_chat_messages(value, data.messages_field), (kind, value))
        message = (
            f'{data.format_field}={kind!r}: data.format=mixed needs "text" or "chat" in field '
            f"{data.format_field!r} (data.format_field)"
        )
        return "bad_format_field", message, None
    reason, message = _check_token_ids(record)
    return reason, message, (record.get("input_ids"), record.get("labels"))


def _skip_rest_of_line(f: Any) -> None:
    """Read past the end of the current line without holding it (chunks of 1 MiB)."""
    while (chunk := f.readline(1 << 20)) and not chunk.endswith(b"\n"):
        pass


def _iter_jsonl(path: Path, max_bytes: int) -> Iterator[ParsedRecord]:
    # bytes in, decoded per line: one bad line (invalid UTF-8, binary junk) is one bad record with its file:line;
    # a line is read to at most max_bytes (data.max_record_bytes), so a runaway one is never held or tokenized
    with open(path, "rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(max_bytes + 1), b""), 1):
            where = f"{path}:{lineno}"
            if len(raw) > max_bytes and not raw.endswith(b"\n"):
                _skip_rest_of_line(f)
                problem = (
                    f"a record longer than data.max_record_bytes={max_bytes} bytes (one line of the file; raise "
                    "data.max_record_bytes to read it, or split the document into several records)"
                )
                yield where, None, problem, "record_too_large"
                continue
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a leading BOM is layout
            except UnicodeDecodeError as e:
                column = len(raw[: e.start].decode("utf-8-sig" if lineno == 1 else "utf-8")) + 1  # characters
                problem = f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {column})"
                yield where, None, problem, "invalid_utf8"
                continue
            if not line.strip():
                continue  # blank lines are layout, not records
            try:
                yield where, json.loads(line), None, ""
            except json.JSONDecodeError as e:
                yield where, None, f"not valid JSON ({e.msg} at column {e.colno})", "malformed_json"


def _iter_parquet(path: Path, column: str, data: DataConfig) -> Iterator[ParsedRecord]:
    pq = require("pyarrow.parquet", "data.source=parquet", "convert the files to JSONL (data=jsonl)")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise UserError(f"{path}: cannot read as Parquet ({e}).") from None
    names = pf.schema_arrow.names
    check_columns(path, names, data)
    columns = [c for c in ((column, "labels") if column == "input_ids" else (column,)) if c in names]
    row = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns or None):
        for record in batch.to_pylist():
            yield f"{path}:row {row}", {c: record.get(c) for c in columns}, None, ""
            row += 1


def iter_raw_docs(data: DataConfig, bad: BadRecords, files: Optional[list[Path]] = None) -> Iterator[RawDoc]:
    """Checked documents of the configured source in file order, at most data.max_docs of them."""
    files = source_files(data) if files is None else files
    count = 0
    for path in _units(data, files):
        if data.max_docs is not None and count >= data.max_docs:
            return
        if data.source == "demo":  # one document per stdlib file (DataConfig makes format=text)
            text = path.read_text(encoding="utf-8", errors="replace")
            records: Iterator[ParsedRecord] = iter([(str(path), {data.text_field: text}, None, "")])
        elif data.source == "jsonl":
            records = _iter_jsonl(path, data.max_record_bytes)
        elif data.source == "hf":
            records = _iter_hf(path, data)
        else:
            column = {"text": data.text_field, "chat": data.messages_field, "pretokenized": "input_ids"}[data.format]
            records = _iter_parquet(path, column, data)
        for where, record, parse_error, parse_reason in records:
            if parse_error is not None:
                bad.report(parse_reason, f"{where}: {parse_error}")
                continue
            reason, message, payload = check_record(record, data)
            if reason is not None:
                bad.report(reason, f"{where}: {message}")
                continue
            yield RawDoc(where, payload)
            count += 1
            if data.max_docs is not None and count >= data.max_docs:
                return
