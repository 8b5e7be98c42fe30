"""flexengine-plan's "how long will my corpus take": the corpus counted in packed rows, then the planner's hours.

`python -m flexengine.plan experiment=deepseek7b_6k_a100 plan.documents=20000 plan.doc_tokens=6000 plan.epochs=1`
The rows come from, in this order of preference:
  plan.documents + plan.doc_tokens   that many documents of that length, packed as training packs them
  plan.tokens                        a token count in full rows (no padding: an optimistic bound)
  the job's data                     data.path (or the demo corpus) tokenized through the training cache and
                                     packed by data.packing: the real lengths, so the real padding
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np

from flexengine.core.config import HardwareConfig, JobConfig
from flexengine.core.errors import UserError
from flexengine.planning.corpus_time import Corpus, corpus_row
from flexengine.planning.shapes import AttendedPairs
from flexengine.resolve import resolve, with_lora_rank
from flexengine.surgery.attention.spec import AttentionSpec

LORA_RANK = 16  # the LoRA alternative's rank when the job has none (a common choice for 7B fine-tunes)
NODE = 8  # the other card count weighed when the job plans one card: a node of them


def corpus_hours(
    job: JobConfig,
    hf_config,
    hardware: HardwareConfig,
    corpus: Corpus,
    *,
    attention: Optional[AttentionSpec] = None,
    pairs: Optional[AttendedPairs] = None,
) -> list[dict]:
    """One row per alternative: the job as planned, then full fine-tune vs LoRA on 1 and NODE cards (each planned
    for its precision, memory policy and micro-batch), with steps, step time, useful tokens/s and hours.
    attention, pairs: as `resolve` takes them (the corpus's packed rows' attended pairs, when known)."""
    rows = []
    for label, variant, hw in _alternatives(job, hardware):
        fit = resolve(variant, hf_config, hw, attention=attention, pairs=pairs).fit
        cp, r = variant.parallel.cp, variant.model.lora.r
        rows.append(corpus_row(label, fit, corpus, world_size=hw.world_size, cp=cp, lora_r=r))
    return rows


def _alternatives(job: JobConfig, hardware: HardwareConfig) -> list[tuple[str, JobConfig, HardwareConfig]]:
    """(label, job, hardware): the job as configured first, then each of full / LoRA x 1 / NODE cards it is not.
    On more cards the accumulation shrinks so the rows per optimizer step stay the job's where they divide (the
    same optimization, done faster), as one would rerun it."""
    lora_r = job.model.lora.r or LORA_RANK
    counts = sorted({hardware.world_size, 1, NODE}) if hardware.on_cuda else [hardware.world_size]
    out = [("as configured", job, hardware)]
    for r in (0, lora_r):
        for n in counts:
            if (r, n) == (job.model.lora.r, hardware.world_size):
                continue
            accum = max(1, round(job.train.grad_accum * hardware.world_size / n))
            variant = with_lora_rank(job, r)
            variant = dataclasses.replace(variant, train=dataclasses.replace(job.train, grad_accum=accum))
            unit = "GPU" if hardware.on_cuda else "CPU"  # the device the rows are planned for, never "GPU" on CPU
            label = f"{'LoRA r=' + str(r) if r else 'full fine-tune'}, {n} {unit}{'s' if n > 1 else ''}"
            out.append((label, variant, dataclasses.replace(hardware, world_size=n)))
    return out


def wants_corpus_time(options: Any) -> bool:
    """Whether the plan was asked how long (plan.epochs, plan.tokens or plan.documents given)."""
    return any(getattr(options, key) is not None for key in ("epochs", "tokens", "documents"))


def corpus_rows(job: JobConfig, options: Any) -> tuple[Corpus, Optional[list[list[int]]]]:
    """The corpus flexengine-plan's options describe, in packed rows of data.seq_len (see the module docstring), and
    its packed rows as their document pieces' lengths (None for plan.tokens: full rows of unknown documents)."""
    from flexengine.data.packing import plan_packing

    epochs = options.epochs if options.epochs is not None else (job.train.epochs or 1.0)
    if epochs <= 0:
        raise UserError(f"plan.epochs={epochs} must be positive.")
    seq_len, data = job.data.seq_len, job.data
    if options.documents is None and options.tokens is not None:
        if options.tokens <= 0:
            raise UserError(f"plan.tokens={options.tokens} must be positive.")
        rows = math.ceil(options.tokens / seq_len)
        what = f"{options.tokens:,.0f} tokens in {rows:,} full rows of {seq_len:,}"
        return Corpus(rows, int(options.tokens), epochs, f"{what} (no padding counted: an optimistic bound)"), None
    lengths, where = document_lengths(job, options)  # held-out documents included, as a run tokenizes them
    packed = plan_packing(lengths, seq_len, data.packing, data.long_docs)
    stats = packed.stats
    what = where if options.documents is not None else f"{where}: {stats.documents:,} documents"
    useful = f"{stats.tokens:,} tokens, {stats.useful_token_fraction:.1%} of slots useful"
    describe = f"{what} -> {stats.rows:,} rows of {stats.seq_len:,} ({useful})"
    pieces = [[length for _doc, _start, length in row] for row in packed.rows]  # what each row's mask separates
    return Corpus(stats.rows, stats.tokens, epochs, describe), pieces


def document_lengths(job: JobConfig, options: Any, what: str = "plan.epochs") -> tuple[np.ndarray, str]:
    """The documents' lengths in tokens and where they come from: plan.documents x plan.doc_tokens, else the job's
    own documents (held-out documents included) tokenized through the training cache. `what`: the option that
    needs them (for the error)."""
    if options.documents is not None:
        if not options.doc_tokens or options.documents <= 0 or options.doc_tokens <= 0:
            raise UserError(
                "plan.documents needs plan.doc_tokens (tokens per document, e.g. plan.documents=20000 "
                "plan.doc_tokens=6000), both positive."
            )
        lengths = np.full(options.documents, options.doc_tokens, dtype=np.int64)
        return lengths, f"{options.documents:,} documents of {options.doc_tokens:,} tokens"
    from flexengine.data.corpus import build_corpus
    from flexengine.surgery.model import load_tokenizer

    if job.data.source != "demo" and not (job.model.path or job.model.tokenizer):
        raise UserError(
            f"{what} with data.path={job.data.path} counts its tokens with the model's tokenizer: give "
            "model.path (or model.tokenizer), or the size instead: plan.tokens=N, or plan.documents=N "
            "plan.doc_tokens=T."
        )
    return build_corpus(job.data, load_tokenizer(job.model)).lengths, job.data.path or "the demo corpus"
