"""Read documents and tokenize them once into a flat token array (+ offsets): the `Corpus` training packs."""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from flexengine.config import DataConfig
from flexengine.data.demo import iter_demo_documents
from flexengine.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Corpus:
    """Tokenized documents: document i is tokens[offsets[i]:offsets[i+1]]."""

    tokens: np.ndarray  # [total_tokens] int32/int64
    offsets: np.ndarray  # [documents + 1] int64
    loss_mask: Optional[np.ndarray] = None  # [total_tokens] bool, False = not trained on (chat prompts); None = all
    skipped: dict = field(default_factory=dict)  # reason -> count of records skipped (data.on_error=skip)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1


def resolve_paths(spec: str) -> list[Path]:
    """Comma-separated files, directories or globs -> sorted existing files; an error names what matched nothing."""
    paths: list[Path] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        matches = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
        found = []
        for m in map(Path, matches):
            if m.is_dir():
                found.extend(sorted(q for q in m.iterdir() if q.is_file()))
            elif m.is_file():
                found.append(m)
        if not found:
            raise UserError(f"data.path: {part!r} matches no file. Give a file, a directory or a glob.")
        paths.extend(found)
    return paths


def _iter_jsonl_texts(data: DataConfig, skipped: dict) -> Iterator[str]:
    for path in resolve_paths(data.path):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    _bad(data, skipped, "malformed_json", f"{where}: not valid JSON ({e.msg} at column {e.colno})")
                    continue
                text = record.get(data.text_field) if isinstance(record, dict) else None
                if text is None:
                    _bad(data, skipped, "missing_field", f"{where}: no {data.text_field!r} field (data.text_field)")
                elif not isinstance(text, str):
                    _bad(data, skipped, "not_a_string", f"{where}: {data.text_field!r} is {type(text).__name__}, not text")
                elif not text.strip():
                    _bad(data, skipped, "empty_document", f"{where}: {data.text_field!r} is empty")
                else:
                    yield text


def _bad(data: DataConfig, skipped: dict, reason: str, message: str) -> None:
    if data.on_error == "raise":
        raise UserError(f"bad record at {message}. Fix the record, or set data.on_error=skip to skip and count such records.")
    skipped[reason] = skipped.get(reason, 0) + 1


def iter_texts(data: DataConfig, skipped: dict) -> Iterator[str]:
    """Document texts of the configured source, in file order."""
    if data.source == "demo":
        return (text for _, text in iter_demo_documents(data.demo_max_files))
    if data.source == "jsonl":
        return _iter_jsonl_texts(data, skipped)
    raise UserError(f"data.source={data.source} is not supported yet")


def build_corpus(data: DataConfig, tokenizer) -> Corpus:
    """Tokenize every document once (before training) into a Corpus."""
    skipped: dict = {}
    eos = [tokenizer.eos_token_id] if data.add_eos and tokenizer.eos_token_id is not None else []
    docs = []
    for text in iter_texts(data, skipped):
        docs.append(np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"] + eos, dtype=np.int64))
        if data.max_docs is not None and len(docs) >= data.max_docs:
            break
    if not docs:
        raise UserError(f"data: no usable documents in {data.path or 'the demo corpus'} (skipped: {skipped or 'none'}).")
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    if skipped:
        log.warning("data: skipped records %s (data.on_error=skip)", skipped)
    return Corpus(tokens=np.concatenate(docs), offsets=offsets, skipped=skipped)
