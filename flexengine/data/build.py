"""A job's rows: tokenize (cached, rank 0 first), hold out whole documents, mix the sources, pack the training
documents into a resumable RowLoader and the held-out ones into HeldOut batches, with the report of both.

The held-out policy: without data.eval_path, data.eval_fraction of the training corpus's documents by content
hash (data/split.py); with it, a corpus of its own whose documents that are also training documents follow
data.eval_overlap. Nothing held out: the log says so when data.path has a split that could have been.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from flexengine.core.config import DataConfig, TrainConfig
from flexengine.core.distributed import DistInfo, main_rank_first
from flexengine.core.errors import UserError
from flexengine.data.corpus import Corpus, build_corpus
from flexengine.data.encode import describe_separator
from flexengine.data.loader import HeldOut, RowLoader
from flexengine.data.mix import build_sources, format_mix_report, mix_documents
from flexengine.data.packing import PackPlan, has_targets, plan_packing
from flexengine.data.sources import unused_eval_split
from flexengine.data.split import describe_eval_source, eval_source, held_out_without_overlap, split_documents

log = logging.getLogger(__name__)


def pad_token_id(tokenizer) -> int:
    """The id used for padding slots (their labels are -100, so any valid id works)."""
    return next((int(t) for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)


def _documents(
    data: DataConfig, train: TrainConfig, tokenizer, dist_info: DistInfo, *, timeout_s: float
) -> tuple[Corpus, Corpus, np.ndarray, np.ndarray, Optional[list[dict]]]:
    """The tokenized corpora (cached) and which documents train and which are held out:
    (corpus, eval corpus, training documents, held-out documents, the mix report or None)."""
    separated = describe_separator(tokenizer, data)
    if separated and dist_info.is_main:
        log.info("data: %s", separated)
    with main_rank_first(dist_info, timeout_s=timeout_s):  # rank 0 fills the cache
        corpus, source_of = build_sources(data, tokenizer)
        eval_corpus = build_corpus(eval_source(data), tokenizer) if data.eval_path else corpus
    train_docs, eval_docs = split_documents(corpus.tokens, corpus.offsets, data.eval_fraction)
    mix_report = None
    if source_of is not None:  # each source's weight as its share of the training tokens
        train_docs, mix_report = mix_documents(corpus.lengths, source_of, train_docs, data.mix, train.seed)
        log.info("data mix: %s", format_mix_report(mix_report))
    if data.eval_path:
        eval_docs = held_out_without_overlap(corpus, train_docs, eval_corpus, data)
    return corpus, eval_corpus, train_docs, eval_docs, mix_report


def training_lengths(
    data: DataConfig, train: TrainConfig, tokenizer, dist_info: DistInfo, *, timeout_s: float
) -> np.ndarray:
    """The training documents' lengths in tokens (the held-out ones and the mixture's weights applied), tokenized
    through the cache build_data then reads: what data.seq_len=auto chooses a row length from. timeout_s:
    parallel.data_timeout_s, how long the other ranks wait for rank 0 to fill the cache."""
    corpus, _, train_docs, _, _ = _documents(data, train, tokenizer, dist_info, timeout_s=timeout_s)
    return np.asarray(corpus.lengths)[train_docs]


def _plan_training_rows(corpus: Corpus, train_docs: np.ndarray, data: DataConfig) -> PackPlan:
    """The training documents packed into rows, refused when no row would carry a target."""
    plan = plan_packing(corpus.lengths, data.seq_len, data.packing, data.long_docs, train_docs)
    log.info("data: %s", plan.stats.describe())
    if plan.stats.rows == 0:
        raise UserError("data: every document was dropped (data.long_docs=drop?); nothing to train on.")
    if not has_targets(plan, corpus.offsets, corpus.loss_mask):
        raise UserError(
            f"data: no packed row has a token to predict (data.seq_len={data.seq_len}): a token is a target "
            "only after an earlier trained token of its document in the same row, and every document piece here "
            "is a single token (or has no trained token after its first). Raise data.seq_len, keep "
            "data.add_eos=true, or use longer documents; training would report a meaningless loss of 0."
        )
    return plan


def _data_report(plan: PackPlan, corpus: Corpus, mix_report: Optional[list[dict]], data: DataConfig) -> dict:
    """The training data's packing statistics, skipped documents, mixture and over-long chats."""
    report = {**plan.stats.as_dict(), "documents_skipped": corpus.skipped}
    if mix_report is not None:
        report["mix"] = mix_report
    if any(f.chats for f in data.format_specs):
        report["chats_longer_than_seq_len"] = {**corpus.chats, "policy": data.long_chats}
    return report


def _held_out(
    tokenizer,
    dist_info: DistInfo,
    eval_corpus: Corpus,
    eval_docs: np.ndarray,
    *,
    data: DataConfig,
    train: TrainConfig,
    trim: bool,
) -> tuple[HeldOut, dict]:
    """The held-out batches and their report (statistics, skipped documents, source)."""
    # packed and masked exactly like the training rows
    eval_plan = plan_packing(eval_corpus.lengths, data.seq_len, data.packing, data.long_docs, eval_docs)
    if eval_plan.stats.rows == 0:
        raise UserError("data: every held-out document was dropped (data.long_docs=drop?); nothing to evaluate.")
    report = {
        **eval_plan.stats.as_dict(),
        "documents_skipped": eval_corpus.skipped,
        "source": (data.eval_path and describe_eval_source(data))
        # no data.eval_path: eval_corpus is the training corpus, eval_docs the share data.eval_fraction held out
        or f"{len(eval_docs)} of {len(eval_corpus)} documents (data.eval_fraction={data.eval_fraction})",
    }
    log.info("eval data: %s, from %s", eval_plan.stats.describe(), report["source"])
    held_out = HeldOut(
        eval_corpus,
        eval_plan,
        seq_len=data.seq_len,
        micro_batch=train.micro_batch,
        pad_id=pad_token_id(tokenizer),
        trim_padding=trim,
        max_batches=train.eval_batches,
        rank=dist_info.data_rank,
        world_size=dist_info.data_world_size,
    )
    return held_out, report


def build_data(
    data: DataConfig,
    train: TrainConfig,
    tokenizer,
    dist_info: DistInfo,
    *,
    timeout_s: float,
    flex: bool = False,
    pin_memory: bool = False,
) -> tuple[RowLoader, Optional[HeldOut], dict]:
    """Tokenize (cached), hold out whole documents, pack: (training loader, held-out batches or None, report).
    timeout_s: parallel.data_timeout_s (training_lengths). flex: the attention backend is FlexAttention (rows keep
    their full length, see below). pin_memory: the training batches go to a CUDA device (pinned, its copies are
    asynchronous)."""
    if data.packing == "auto":
        raise UserError(
            "data.packing=auto is decided by attn.mode (bfd when the mode packs documents, else none): resolve the "
            "job first (flexengine.surgery.attention.job_rules.resolve_attention_rules(job.attn, job.data, job.model); "
            "a job composed by the CLI or cli.common.compose_job already is), or set data.packing."
        )
    corpus, eval_corpus, train_docs, eval_docs, mix_report = _documents(
        data, train, tokenizer, dist_info, timeout_s=timeout_s
    )
    plan = _plan_training_rows(corpus, train_docs, data)
    # Flex compiles for one row shape: trimming one-document rows to each batch's longest would recompile
    # on nearly every batch, so flex keeps full rows (the dense and sdpa paths trim).
    trim = data.packing == "none" and not flex
    try:
        loader = RowLoader(
            corpus,
            plan,
            seq_len=data.seq_len,
            micro_batch=train.micro_batch,
            pad_id=pad_token_id(tokenizer),
            seed=train.seed,
            shuffle=data.shuffle,
            bucket=data.bucket,
            trim_padding=trim,
            rank=dist_info.data_rank,
            world_size=dist_info.data_world_size,
            pin_memory=pin_memory,
        )
    except ValueError as e:
        raise UserError(f"{e}.") from None
    report = _data_report(plan, corpus, mix_report, data)
    if not len(eval_docs):
        if unused := unused_eval_split(data):  # nothing held out: name the split data.path has that could have been
            log.info(
                "data: %s has a %r split, not evaluated on: add data.eval_path=%s (its %s split is taken)",
                data.path,
                unused,
                data.path,
                unused,
            )
        return loader, None, report
    held_out, report["eval"] = _held_out(
        tokenizer, dist_info, eval_corpus, eval_docs, data=data, train=train, trim=trim
    )
    return loader, held_out, report
