"""Read raw documents from the demo corpus, JSON Lines, Parquet or HF datasets, checking each record where it is read.

One path for every source: its reader (`READERS`) yields each record with where it is -- "file:line" (JSONL), "file:row
N" (Parquet, a data file through HF `datasets`; 0-based) or "dir[split]:row N" (a saved DatasetDict; tables are read
as Arrow batches of the columns data.format reads) -- and the format's check (core/data_formats.py) makes it a
`RawDoc(where, payload)`. A bad record goes through `BadRecords.report`: data.on_error=raise stops the run with the
location and what to do, skip counts it under its reason. A file that cannot be opened, or a table without the column
the format needs, is a config error naming the file and what to change.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Optional

from flexengine.core.config import DataConfig
from flexengine.core.data_formats import data_format, function_named
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
HF_BUILDERS = (
    dict.fromkeys(SUFFIXES["jsonl"], "json") | dict.fromkeys(SUFFIXES["parquet"], "parquet") | {".arrow": "arrow"}
)
TABLE_BATCH_ROWS = 1024  # rows per Arrow batch read from a Parquet file or an HF dataset
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
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    datasets = require("datasets", "data.source=hf", "read the files directly with data=jsonl / data=parquet")
    datasets.config.HF_DATASETS_OFFLINE = True  # also when it was imported before the variables were set
    datasets.config.HF_HUB_OFFLINE = True
    return datasets


def check_columns(where: str, columns: list[str], data: DataConfig) -> list[str]:
    """The columns data.format reads that a table (Parquet, HF dataset) has. One it needs and lacks is a config
    error naming the key and the columns there are, not a bad record: data.on_error=skip would skip every row."""
    fmt = data_format(data.format)
    name, key = fmt.needed(data)
    if name not in columns:
        fix = f"Set {key} to the column holding them, e.g. {key}={columns[0]}" if key and columns else ""
        raise UserError(
            f"{where}: no column {name!r} ({key or 'data.format=' + data.format}); its columns are "
            f"{', '.join(map(repr, columns)) or 'none'}. {fix or f'data.format={data.format} needs that column'}."
        )
    return [c for c in fmt.columns(data) if c in columns]


def _unreadable(path: Path, how: str, error: Exception, fix: str) -> UserError:
    """A file a reader cannot open at all: where, what failed and what to do (no record of it was read)."""
    return UserError(f"{path}: cannot {how} ({type(error).__name__}: {error}). {fix}")


def _load_hf(path: Path, data: DataConfig) -> tuple[Any, str]:
    """(the dataset, where its rows are: the path, or path[split] of a saved DatasetDict), through HF `datasets`."""
    datasets = _import_datasets()
    try:
        if is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))
        else:
            from flexengine.data.cache import corpus_cache_dir

            cache = str(corpus_cache_dir(data.cache_dir).parent / "hf-datasets")
            ds = datasets.load_dataset(HF_BUILDERS[path.suffix], data_files=str(path), split="train", cache_dir=cache)
    except Exception as e:  # datasets/pyarrow raise many types for unreadable files
        raise _unreadable(path, "load with HF datasets", e, "For file:line errors, read it with data=jsonl.") from None
    if not isinstance(ds, datasets.DatasetDict):
        return ds, str(path)
    if data.hf_split not in ds:
        raise UserError(
            f"data.path={path}: no split {data.hf_split!r} (data.hf_split); it has {', '.join(ds)}: set "
            "data.hf_split to one of them."
        )
    return ds[data.hf_split], f"{path}[{data.hf_split}]"


def _units(data: DataConfig, files: list[Path]) -> list[Path]:
    """What iter_raw_docs opens one by one: the files, or the saved dataset directory as one unit."""
    saved = Path(data.path or "")
    if data.source == "hf" and is_saved_dataset(saved):
        return [saved]
    return files


# -- records: each format's check (core/data_formats.py names them) ----------------------------------------------
Checked = tuple[Optional[str], str, Any]  # (reason, None when good; the problem; the payload to encode)
_FORMAT_HINT = "Set data.format={fmt} (in a data.mix, format: {fmt} on that source)"


def _null(record: dict, name: str) -> Optional[Checked]:
    """A field that is there but null: named as a null, not as absent."""
    if name in record and record[name] is None:
        return "null_field", f"{name!r} is null (JSON null): the field is there, without a value", None
    return None


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


def check_token_record(record: dict, data: DataConfig) -> Checked:
    """format=pretokenized: input_ids, and labels that keep or mask each (payload: (input_ids, labels or None))."""
    ids, labels = record.get("input_ids"), record.get("labels")
    if ids is None:
        return _null(record, "input_ids") or ("missing_field", "no 'input_ids' field", None)
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return "bad_token_ids", "'input_ids' must be a non-empty list of integers", None
    if labels is not None and (not isinstance(labels, list) or len(labels) != len(ids)):
        return "bad_labels", f"'labels' must be a list as long as 'input_ids' ({len(ids)})", None
    # Packed rows take labels from input_ids, so only "train on this token" (= input id) or -100 can be kept.
    for i, (t, label) in enumerate(zip(ids, labels or ids)):
        if label != t and label != -100:
            return "bad_labels", f"labels[{i}]={label!r} is neither input_ids[{i}]={t} nor -100", None
    return None, "", (ids, labels)


def _one_field(record: dict, name: str, check: Any, other: str, other_format: str) -> Checked:
    """The field `name`, checked; where it is missing and the record has `other`, the format to set instead."""
    value = record.get(name)
    reason, message = check(value, name)
    if reason == "missing_field" and other in record:
        message += f"; it has {other!r}: a {other_format} record? {_FORMAT_HINT.format(fmt=other_format)}"
    return _null(record, name) or (reason, message, value)


def check_text_record(record: dict, data: DataConfig) -> Checked:
    """format=text: a non-empty string in data.text_field (payload: the text)."""
    return _one_field(record, data.text_field, _check_text, data.messages_field, "chat")


def check_chat_record(record: dict, data: DataConfig) -> Checked:
    """format=chat: a conversation in data.messages_field (payload: its turns)."""
    return _one_field(record, data.messages_field, check_chat_messages, data.text_field, "text")


# what a mixed record may say it is in data.format_field: how its value is checked, and the data.* key naming it
_MIXED_KINDS = {"text": (_check_text, "text_field"), "chat": (check_chat_messages, "messages_field")}


def check_mixed_record(record: dict, data: DataConfig) -> Checked:
    """format=mixed: data.format_field says which kind the record is (payload: (that kind, its value))."""
    kind = record.get(data.format_field)
    part = _MIXED_KINDS.get(kind) if isinstance(kind, str) else None
    if part is None:
        kinds = " or ".join(f'"{k}"' for k in _MIXED_KINDS)
        problem = f"{data.format_field}={kind!r}: data.format=mixed needs {kinds} in field {data.format_field!r}"
        return _null(record, data.format_field) or ("bad_format_field", problem + " (data.format_field)", None)
    check, name = part[0], getattr(data, part[1])
    return _null(record, name) or (*check(record.get(name), name), (kind, record.get(name)))


# -- readers: every source yields (where, record, parse problem, its reason) ---------------------------------------
def _skip_rest_of_line(f: Any) -> None:
    """Read past the end of the current line without holding it (chunks of 1 MiB)."""
    while (chunk := f.readline(1 << 20)) and not chunk.endswith(b"\n"):
        pass


def _read_jsonl(path: Path, data: DataConfig) -> Iterator[ParsedRecord]:
    """The lines of a JSON Lines file, each at `file:line` (1-based; blank lines are layout, not records)."""
    # bytes in, decoded per line: one bad line (invalid UTF-8, binary junk) is one bad record with its file:line;
    # a line is read to at most data.max_record_bytes, so a runaway one is never held or tokenized
    max_bytes = data.max_record_bytes
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
                continue
            try:
                yield where, json.loads(line), None, ""
            except json.JSONDecodeError as e:
                yield where, None, f"not valid JSON ({e.msg} at column {e.colno})", "malformed_json"


def _rows(where: str, batches: Iterable[Any]) -> Iterator[ParsedRecord]:
    """The records of a table's Arrow batches (a Parquet file's, an HF dataset's), each at `where:row N` (0-based)."""
    records = itertools.chain.from_iterable(batch.to_pylist() for batch in batches)
    for row, record in enumerate(records):
        yield f"{where}:row {row}", record, None, ""


def _read_parquet(path: Path, data: DataConfig) -> Iterator[ParsedRecord]:
    """The rows of a Parquet file, only the columns data.format reads."""
    pq = require("pyarrow.parquet", "data.source=parquet", "convert the files to JSONL (data=jsonl)")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise _unreadable(path, "read as Parquet", e, "Replace the file, or leave it out of data.path.") from None
    columns = check_columns(str(path), pf.schema_arrow.names, data)
    yield from _rows(str(path), pf.iter_batches(batch_size=TABLE_BATCH_ROWS, columns=columns))


def _read_hf(path: Path, data: DataConfig) -> Iterator[ParsedRecord]:
    """The rows of a save_to_disk directory (its data.hf_split) or a local data file, in Arrow batches as Parquet's."""
    ds, where = _load_hf(path, data)
    columns = check_columns(where, list(ds.column_names), data)
    yield from _rows(where, ds.select_columns(columns).with_format("arrow").iter(batch_size=TABLE_BATCH_ROWS))


def _read_demo(path: Path, data: DataConfig) -> Iterator[ParsedRecord]:
    """One standard-library file as one text record (DataConfig allows only formats that read the text field)."""
    yield str(path), {data.text_field: path.read_text(encoding="utf-8", errors="replace")}, None, ""


READERS = {"demo": _read_demo, "jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf}  # by data.source


def iter_raw_docs(data: DataConfig, bad: BadRecords, files: Optional[list[Path]] = None) -> Iterator[RawDoc]:
    """Checked documents of the configured source in file order, at most data.max_docs of them."""
    files = source_files(data) if files is None else files
    read, check = READERS[data.source], function_named(data_format(data.format).check)
    count = 0
    for path in _units(data, files):
        if data.max_docs is not None and count >= data.max_docs:
            return
        for where, record, parse_error, parse_reason in read(path, data):
            if parse_error is not None:
                bad.report(parse_reason, f"{where}: {parse_error}")
                continue
            if isinstance(record, dict):
                reason, message, payload = check(record, data)
            else:
                reason, message, payload = "not_an_object", f"record is {type(record).__name__}, not an object", None
            if reason is not None:
                bad.report(reason, f"{where}: {message}")
                continue
            yield RawDoc(where, payload)
            count += 1
            if data.max_docs is not None and count >= data.max_docs:
                return
