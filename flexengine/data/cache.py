"""On-disk cache of a tokenized corpus: flat token array + offsets (+ loss mask), memory-mapped on load.

Layout of one entry, `<cache_dir>/corpus/<key>/`:
  tokens.npy     [total_tokens] int32   document i = tokens[offsets[i]:offsets[i+1]]
  offsets.npy    [documents + 1] int64
  loss_mask.npy  [total_tokens] bool    only when some token is not trained on (chat prompts, labels=-100)
  meta.json      counts, skipped records, the key's inputs (written last: its presence marks a complete entry)
The key hashes everything the tokens depend on: each file's path, size and mtime, the tokenizer's full
definition, and the format options. An entry is written under a temporary name and renamed into place, so a
crash or a concurrent run never leaves a half-written entry that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any, Optional

import numpy as np

from flexengine.core.config import DataConfig
from flexengine.core.data_formats import data_format
from flexengine.core.storage import pid_alive

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when the layout or the encoding rules change (2: text documents end with the
# base model's end-of-text, not an instruct tokenizer's end-of-turn EOS)
_NPY_HEADER_BYTES = 128  # numpy pads a 1-D v1.0 header to 64-byte multiples: 128 fits any length


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the tokenizer's full definition (vocab, merges, normalizer, added tokens) and chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizers: the vocabulary is what we can see
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "eos": tokenizer.eos_token_id,
        "bos": getattr(tokenizer, "bos_token_id", None),
        "add_bos": getattr(tokenizer, "add_bos_token", None),
        "add_eos": getattr(tokenizer, "add_eos_token", None),
    }
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key_inputs(data: DataConfig, files: list[Path], tokenizer) -> dict:
    """Everything the tokenized corpus depends on, as a JSON-able dict."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    keys = ["source", "format", "text_field", "messages_field", "max_docs", "on_error", "add_eos", "max_record_bytes"]
    keys.append("separator")  # null resolves from the tokenizer alone, which the fingerprint covers
    if data.source == "hf":  # one saved DatasetDict holds several splits: each is its own corpus
        keys.append("hf_split")
    keys += data_format(data.format).options  # what its encoding depends on besides (text ignores seq_len)
    return {
        "version": CACHE_VERSION,
        "files": stats,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": {k: getattr(data, k) for k in keys},
    }


def cache_key(inputs: dict) -> str:
    """Short stable hash of cache_key_inputs."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def corpus_cache_dir(cache_dir: Optional[str]) -> Path:
    """data.cache_dir, or the default flexengine cache, + /corpus."""
    from flexengine.data.demo import default_cache_dir

    return (Path(cache_dir) if cache_dir else default_cache_dir()) / "corpus"


def array_sha256(array: np.ndarray, chunk: int = 1 << 24) -> str:
    """sha256 of an array's data bytes (chunked, so a memory-mapped corpus is never copied whole)."""
    h = hashlib.sha256()
    flat = array.reshape(-1)
    for start in range(0, len(flat), chunk):
        h.update(np.ascontiguousarray(flat[start : start + chunk]).tobytes())
    return h.hexdigest()


def corpus_digest(tokens_sha: str, offsets: np.ndarray, mask_sha: Optional[str]) -> str:
    """One sha256 for a tokenized corpus: its tokens, document boundaries and loss mask (None = all trained)."""
    h = hashlib.sha256(tokens_sha.encode())
    h.update(np.ascontiguousarray(offsets, dtype=np.int64).tobytes())
    h.update((mask_sha or "").encode())
    return h.hexdigest()


class _NpyAppender:
    """Writes a 1-D .npy file chunk by chunk: the data streams after a reserved header filled in on close."""

    def __init__(self, path: Path, dtype: Any):
        self.path, self.dtype, self.length = path, np.dtype(dtype), 0
        self.file = open(path, "wb")  # noqa: SIM115 -- held open across append() calls, closed by close()
        self.file.seek(_NPY_HEADER_BYTES)
        self.sha256 = hashlib.sha256()  # of the data bytes, as `array_sha256` computes it for the whole array

    def append(self, array: np.ndarray) -> None:
        """Add elements at the end."""
        data = np.ascontiguousarray(array, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.length += len(array)

    def close(self) -> None:
        """Write the header for the final length."""
        self.file.seek(0)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.length,)}
        np.lib.format.write_array_header_1_0(self.file, header)
        assert self.file.tell() == _NPY_HEADER_BYTES, "npy header outgrew its reserved space"
        self.file.close()


_TMP_ENTRY = re.compile(r"^.+\.tmp_(?P<host>.+)_(?P<pid>\d+)$")


def clean_stale_entries(corpus_dir: Path) -> list[Path]:
    """Remove the temporary entries of tokenizing processes of this host that are gone; returns them. A SIGTERM or
    SIGKILL during tokenization ends the process before any cleanup runs, and its `<key>.tmp_<host>_<pid>`
    directory (up to the corpus's size) would stay forever. Other hosts' entries (a shared cache) are left alone."""
    host, removed = socket.gethostname(), []
    for p in sorted(corpus_dir.iterdir()) if corpus_dir.is_dir() else []:
        m = _TMP_ENTRY.match(p.name)
        if m and m["host"] == host and int(m["pid"]) != os.getpid() and not pid_alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


class CorpusWriter:
    """Streams documents into a new cache entry; `commit` makes it visible atomically, `abort` removes it."""

    def __init__(self, directory: Path, with_mask: bool, token_dtype: Any = np.int32):
        self.directory = directory
        clean_stale_entries(directory.parent)
        self.tmp = directory.with_name(f"{directory.name}.tmp_{socket.gethostname()}_{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.tokens = _NpyAppender(self.tmp / "tokens.npy", token_dtype)
        self.mask = _NpyAppender(self.tmp / "loss_mask.npy", bool) if with_mask else None
        self.lengths: list[int] = []
        self.masked_tokens = 0  # tokens not trained on; 0 at commit -> no loss_mask file

    def append(self, ids: np.ndarray, loss_mask: Optional[np.ndarray]) -> None:
        """Add one document."""
        self.tokens.append(ids)
        if self.mask is not None:
            self.mask.append(np.ones(len(ids), dtype=bool) if loss_mask is None else loss_mask)
        self.masked_tokens += 0 if loss_mask is None else int(len(ids) - loss_mask.sum())
        self.lengths.append(len(ids))

    def commit(self, meta: dict) -> Path:
        """Finish the files and rename the entry into place; returns its directory."""
        self.tokens.close()
        if self.mask is not None:
            self.mask.close()
            if self.masked_tokens == 0:
                (self.tmp / "loss_mask.npy").unlink()
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        np.save(self.tmp / "offsets.npy", offsets)
        mask_sha = self.mask.sha256.hexdigest() if self.mask is not None and self.masked_tokens else None
        digest = corpus_digest(self.tokens.sha256.hexdigest(), offsets, mask_sha)
        meta = {
            **meta,
            "documents": len(self.lengths),
            "tokens": int(offsets[-1]),
            "masked_tokens": self.masked_tokens,
            "content_sha256": digest,
        }
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if self.directory.exists() and not (self.directory / "meta.json").exists():
            shutil.rmtree(self.directory)  # an entry damaged by hand; complete ones always have meta.json
        try:
            os.replace(self.tmp, self.directory)
        except OSError:  # another process committed the same key first; its entry is identical
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.directory

    def abort(self) -> None:
        """Discard the partial entry."""
        for appender in (self.tokens, self.mask):
            if appender is not None:
                appender.file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def load_entry(directory: Path) -> Optional[tuple[np.ndarray, np.ndarray, Optional[np.ndarray], dict]]:
    """(tokens, offsets, loss_mask|None, meta) of a complete entry, memory-mapped; None if absent."""
    if not (directory / "meta.json").exists():
        return None
    meta = json.loads((directory / "meta.json").read_text())
    # allow_pickle=False (numpy's default, said here on purpose): a planted object array cannot run code
    tokens = np.load(directory / "tokens.npy", mmap_mode="r", allow_pickle=False)
    offsets = np.load(directory / "offsets.npy", allow_pickle=False)
    mask_path = directory / "loss_mask.npy"
    loss_mask = np.load(mask_path, mmap_mode="r", allow_pickle=False) if mask_path.exists() else None
    return tokens, offsets, loss_mask, meta


def entry_problem(tokens: np.ndarray, offsets: np.ndarray, vocab_size: int) -> Optional[str]:
    """Why an entry's arrays cannot be trained on (None: they can): offsets that do not span the tokens, or ids
    outside the tokenizer's vocabulary (which would fail the first forward with an IndexError). Two passes over the
    tokens (min, max), once per load."""
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(tokens) or bool(np.any(np.diff(offsets) < 0)):
        return f"its offsets.npy does not span its {len(tokens):,} tokens"
    if len(tokens):
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            return f"its tokens.npy holds ids {low}..{high}, outside the tokenizer's vocabulary of {vocab_size:,}"
    return None


def load_checked_entry(
    directory: Path, vocab_size: int
) -> Optional[tuple[np.ndarray, np.ndarray, Optional[np.ndarray], dict]]:
    """load_entry, with its arrays checked against the tokenizer (entry_problem): a damaged or tampered entry is
    named in a warning and removed (None: the caller tokenizes again)."""
    entry = load_entry(directory)
    if entry is None:
        return None
    problem = entry_problem(entry[0], entry[1], vocab_size)
    if problem is None:
        return entry
    log.warning("data: the cache entry %s is damaged (%s): removed, tokenizing again", directory, problem)
    shutil.rmtree(directory, ignore_errors=True)
    return None
