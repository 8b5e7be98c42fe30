"""Tokenize every document once, before training, into a cached flat token array: the `Corpus` training packs.

read + check records (sources.py) -> encode in worker processes (encode.py) -> stream into a cache entry
(cache.py) -> memory-map it. A second run with the same files, tokenizer and options only memory-maps.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np
from tqdm import tqdm

from flexengine.core.config import DataConfig
from flexengine.core.data_formats import data_format
from flexengine.core.errors import UserError
from flexengine.data.cache import (
    CorpusWriter,
    array_sha256,
    cache_key,
    cache_key_inputs,
    corpus_cache_dir,
    corpus_digest,
    load_checked_entry,
    load_entry,
)
from flexengine.data.encode import Dropped, Encoder, Rejected, encode_in_worker, init_worker
from flexengine.data.sources import BadRecords, RawDoc, iter_raw_docs, source_files

log = logging.getLogger(__name__)

BATCH_DOCS = 32  # documents per tokenizer call / worker task: amortises IPC without starving the bar
IN_FLIGHT_PER_WORKER = 4  # batches queued per worker: keeps workers busy while bounding memory


@dataclass
class Corpus:
    """Tokenized documents: document i is tokens[offsets[i]:offsets[i+1]]."""

    tokens: np.ndarray  # [total_tokens] int32 (memory-mapped from the cache)
    offsets: np.ndarray  # [documents + 1] int64
    loss_mask: Optional[np.ndarray] = None  # [total_tokens] bool, False = not trained on (chat prompts); None = all
    skipped: dict = field(default_factory=dict)  # reason -> count of records skipped (data.on_error=skip)
    chats: dict = field(default_factory=dict)  # conversations longer than seq_len: {"truncated": n, "dropped": n}
    cache_path: Optional[Path] = None  # the cache entry this corpus was loaded from
    cache_hit: bool = False  # True when no tokenization happened in this process
    digest: Optional[str] = None  # sha256 of tokens + offsets + loss mask (see `fingerprint`)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def fingerprint(self) -> str:
        """sha256 of the content (tokens, document boundaries, loss mask): the cache entry's, else computed.
        Unlike the cache key it does not change when the same files are copied or touched."""
        if self.digest is None:
            mask_sha = None if self.loss_mask is None else array_sha256(self.loss_mask)
            self.digest = corpus_digest(array_sha256(self.tokens), self.offsets, mask_sha)
        return self.digest


def _batches(docs: Iterable[RawDoc], size: int) -> Iterator[list[RawDoc]]:
    docs = iter(docs)
    while batch := list(itertools.islice(docs, size)):
        yield batch


def encode_stream(encoder: Encoder, docs: Iterable[RawDoc], num_workers: int) -> Iterator[tuple[RawDoc, Any]]:
    """(doc, Encoded | Rejected) in input order; num_workers > 1 encodes in that many processes."""
    if num_workers <= 1:
        for batch in _batches(docs, BATCH_DOCS):
            yield from zip(batch, encoder.encode_batch(batch))
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"  # fork: no tokenizer pickling per worker
    # Workers run one tokenizer thread each; setting this across the fork also silences tokenizers' warning
    # about forking a process whose tokenizer already used threads (the demo tokenizer's training does).
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = mp.get_context(method).Pool(num_workers, initializer=init_worker, initargs=(encoder,))
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    try:
        pending: collections.deque = collections.deque()
        for batch in _batches(docs, BATCH_DOCS):
            pending.append((batch, pool.apply_async(encode_in_worker, (batch,))))
            while len(pending) >= IN_FLIGHT_PER_WORKER * num_workers:
                done, result = pending.popleft()
                yield from zip(done, result.get())
        while pending:
            done, result = pending.popleft()
            yield from zip(done, result.get())
    finally:
        pool.terminate()


def tokenize_to_cache(data: DataConfig, tokenizer, files: list[Path], directory: Path, key_inputs: dict) -> Path:
    """Read, check and encode every document into a new cache entry; returns its directory."""
    start = time.perf_counter()
    bad = BadRecords(data.on_error)
    encoder = Encoder.from_config(tokenizer, data)
    writer = CorpusWriter(directory, with_mask=data_format(data.format).has_mask)
    chats = {"truncated": 0, "dropped": 0}  # data.long_chats at work (a policy, not bad records)
    total = len(files) if data.source == "demo" else data.max_docs  # JSONL/Parquet record counts are unknown
    bar = tqdm(total=total, unit="doc", desc="tokenize", disable=None, leave=False)
    try:
        for doc, result in encode_stream(encoder, iter_raw_docs(data, bad, files), data.num_workers):
            if isinstance(result, Rejected):
                bad.report(result.reason, result.message)
            elif isinstance(result, Dropped):
                chats["dropped"] += 1
            elif len(result.ids) == 0:  # packing would have nothing to place: count it here, not silently
                bad.report("empty_document", f"{doc.where}: tokenized to zero tokens")
            else:
                writer.append(result.ids, result.loss_mask)
                chats["truncated"] += result.truncated
                bar.update(1)
        if not writer.lengths:
            raise UserError(
                f"data: no usable documents in {data.path or 'the demo corpus'} (skipped: {bad.counts or 'none'}; "
                f"conversations longer than data.seq_len dropped: {chats['dropped']})."
            )
        seconds = time.perf_counter() - start
        meta = {
            "key": key_inputs,
            "skipped": bad.counts,
            "tokenize_s": seconds,
            "num_workers": data.num_workers,
            "chats": chats,
            "assistant_mask": encoder.describe_mask() if data_format(data.format).chats else None,
        }
        writer.commit(meta)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    log.info(
        "data: tokenized %d documents (%d tokens) in %.1f s with %d worker(s); cached in %s",
        len(writer.lengths),
        sum(writer.lengths),
        seconds,
        max(1, data.num_workers),
        directory,
    )
    return directory


def log_trained_tokens(meta: dict, loss_mask: np.ndarray) -> None:
    """How many tokens carry loss and how many are masked (chat prompts, pretokenized -100 labels)."""
    total = len(loss_mask)
    masked = meta.get("masked_tokens")
    trained = total - masked if masked is not None else int(np.count_nonzero(loss_mask))
    how = f", assistant replies found by {meta['assistant_mask']}" if meta.get("assistant_mask") else ""
    log.info(
        "data: loss on %s of %s tokens (%.1f%%), %s masked%s",
        f"{trained:,}",
        f"{total:,}",
        100 * trained / max(1, total),
        f"{total - trained:,}",
        how,
    )


def build_corpus(data: DataConfig, tokenizer) -> Corpus:
    """Tokenize every document once (or load the cached result) into a memory-mapped Corpus."""
    files = source_files(data)
    key_inputs = cache_key_inputs(data, files, tokenizer)
    directory = corpus_cache_dir(data.cache_dir) / cache_key(key_inputs)
    start = time.perf_counter()
    entry = load_checked_entry(directory, len(tokenizer))  # a tampered entry is tokenized again
    hit = entry is not None
    if entry is not None:
        log.info("data: cache hit %s (loaded in %.3f s, no tokenization)", directory, time.perf_counter() - start)
    else:
        entry = load_entry(tokenize_to_cache(data, tokenizer, files, directory, key_inputs))
        assert entry is not None, f"cache entry {directory} vanished right after it was written"
    tokens, offsets, loss_mask, meta = entry
    skipped = dict(meta["skipped"])
    if skipped:
        log.warning(
            "data: skipped %d bad records (data.on_error=skip): %s",
            sum(skipped.values()),
            ", ".join(f"{n:,} {reason}" for reason, n in sorted(skipped.items())),
        )
    chats = dict(meta.get("chats", {}))
    if any(chats.values()):
        log.warning(
            "data: conversations longer than data.seq_len=%d: %d truncated at a turn boundary, %d dropped "
            "(data.long_chats=%s)",
            data.seq_len,
            chats["truncated"],
            chats["dropped"],
            data.long_chats,
        )
    if loss_mask is not None:
        log_trained_tokens(meta, loss_mask)
    return Corpus(
        tokens,
        offsets,
        loss_mask,
        skipped,
        chats=chats,
        cache_path=directory,
        cache_hit=hit,
        digest=meta.get("content_sha256"),
    )
