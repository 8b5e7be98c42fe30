"""Data mixtures (data.mix): several sources, each tokenized and cached on its own, combined into one corpus,
then whole documents repeated or subsampled so each source gets its weight's share of the training tokens.

Shares are reached in tokens, not documents (a source of long documents is not over-weighted), by whole
documents (nothing is cut), deterministically from train.seed. The per-source report (tokens available / used,
share, repeats) goes into the packing report and summary.json.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import Counter
from typing import Any, Optional

import numpy as np

from flexengine.core.config import DataConfig, MixSource
from flexengine.core.errors import UserError
from flexengine.data.cache import CorpusWriter, corpus_cache_dir, load_entry
from flexengine.data.corpus import Corpus, build_corpus

log = logging.getLogger(__name__)


def part_config(data: DataConfig, part: MixSource) -> DataConfig:
    """data.* for one source of the mixture (its own source and format, else data.*'s)."""
    return dataclasses.replace(
        data,
        source=part.source or data.source,
        format=part.format or data.format,
        path=part.path,
        mix=[],
        eval_path=None,
        eval_split=None,
    )


def _concatenate(parts: list[Corpus], data: DataConfig) -> Corpus:
    """One corpus holding every part's documents in order, itself a cache entry (streamed, memory-mapped)."""
    key = hashlib.sha256("|".join(str(p.cache_path) for p in parts).encode()).hexdigest()[:24]
    directory = corpus_cache_dir(data.cache_dir) / f"mix-{key}"
    if load_entry(directory) is None:
        writer = CorpusWriter(directory, with_mask=any(p.loss_mask is not None for p in parts))
        try:
            for part in parts:
                for d in range(len(part)):
                    a, b = part.offsets[d], part.offsets[d + 1]
                    writer.append(
                        np.asarray(part.tokens[a:b]),
                        None if part.loss_mask is None else np.asarray(part.loss_mask[a:b]),
                    )
            writer.commit({"parts": [str(p.cache_path) for p in parts], "skipped": {}})
        except BaseException:
            writer.abort()
            raise
    entry = load_entry(directory)
    assert entry is not None, f"cache entry {directory} vanished right after it was written"
    tokens, offsets, loss_mask, _ = entry
    skipped, chats = Counter[str](), Counter[str]()  # update keeps zero counts: every part's keys are reported
    for p in parts:
        skipped.update(p.skipped)
        chats.update(p.chats)
    return Corpus(tokens, offsets, loss_mask, dict(skipped), chats=dict(chats), cache_path=directory)


def build_sources(data: DataConfig, tokenizer) -> tuple[Corpus, Optional[np.ndarray]]:
    """The corpus of data.path, or the concatenated corpus of data.mix with, per document, its source index."""
    if not data.mix:
        return build_corpus(data, tokenizer), None
    parts = [build_corpus(part_config(data, m), tokenizer) for m in data.mix]
    source_of = np.concatenate([np.full(len(p), i, dtype=np.int64) for i, p in enumerate(parts)])
    return _concatenate(parts, data), source_of


def mix_documents(
    lengths: np.ndarray, source_of: np.ndarray, candidates: np.ndarray, mix: list[MixSource], seed: int
) -> tuple[np.ndarray, list[dict]]:
    """Training document indices (repeats allowed) giving each source its weight's share of the tokens, and the
    per-source report. candidates: the documents that may be used (the held-out ones excluded)."""
    candidates = np.asarray(candidates, dtype=np.int64)
    weights = np.array([m.weight for m in mix], dtype=np.float64)
    weights /= weights.sum()
    total = int(lengths[candidates].sum())
    chosen: list[np.ndarray] = []
    report: list[dict[str, Any]] = []  # JSON rows (str, int and float values), one per source
    for i, part in enumerate(mix):
        docs = candidates[source_of[candidates] == i]
        available = int(lengths[docs].sum())
        if available == 0:
            raise UserError(
                f"data.mix[{i}] ({part.name or part.path}) has no training tokens (all held out or "
                "dropped?); remove it or lower data.eval_fraction."
            )
        target = weights[i] * total
        repeats, rest = divmod(target, available)
        order = docs[np.random.default_rng([seed, i]).permutation(len(docs))]
        # whole documents up to the remainder: the first ones whose running total reaches it
        cut = int(np.searchsorted(np.cumsum(lengths[order]), rest, side="left")) + (rest > 0)
        picked = np.concatenate([np.tile(docs, int(repeats)), order[:cut]])
        chosen.append(picked)
        report.append(
            {
                "source": part.name or part.path,
                "weight": float(weights[i]),
                "documents": len(docs),
                "tokens_available": available,
                "tokens_used": int(lengths[picked].sum()),
                "documents_used": len(picked),
            }
        )
    used = sum(r["tokens_used"] for r in report)
    for r in report:
        r["share"] = r["tokens_used"] / max(1, used)
        r["repeats"] = r["tokens_used"] / r["tokens_available"]
    return np.sort(np.concatenate(chosen)), report


def format_mix_report(report: list[dict]) -> str:
    """One line per source for the log."""
    return "; ".join(
        f"{r['source']}: weight {r['weight']:.3f} -> {r['share']:.3f} of {r['tokens_used']:,} tokens "
        f"(x{r['repeats']:.2f} of {r['tokens_available']:,})"
        for r in report
    )
