"""flexengine-plan's corpus for "how long": documents of one length packed as training packs them, a bare token
count in full rows, or the job's own documents."""

from __future__ import annotations

import math

import pytest

from flexengine.cli.common import compose_job
from flexengine.cli.plan import PlanOptions
from flexengine.cli.plan_corpus import corpus_of, wants_corpus_time
from flexengine.core.errors import UserError
from flexengine.data.packing import plan_packing


def test_documents_of_one_length_are_packed_with_their_padding():
    """The seed workload: 20,000 documents of ~6,000 tokens in 8K rows hold one each (two do not fit): 73 % of
    each row is useful, which the hours must count."""
    job = compose_job(["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "data.seq_len=8192"])
    corpus = corpus_of(job, PlanOptions(documents=20_000, doc_tokens=6_000, epochs=1))
    assert (corpus.rows, corpus.useful_tokens, corpus.epochs) == (20_000, 120_000_000, 1)
    assert "73.2% of slots useful" in corpus.describe
    shorter = compose_job(
        ["experiment=deepseek7b_6k_a100", "model.init=random", "data.source=demo", "data.seq_len=6144"]
    )
    assert corpus_of(shorter, PlanOptions(documents=20_000, doc_tokens=6_000)).rows == 20_000  # 97.7 % useful


def test_a_token_count_fills_rows_and_the_data_is_counted_otherwise():
    job = compose_job(["debug=fast"])
    corpus = corpus_of(job, PlanOptions(tokens=1e6, epochs=3))
    assert corpus.rows == math.ceil(1e6 / 256) and corpus.epochs == 3 and "optimistic" in corpus.describe
    demo = corpus_of(job, PlanOptions(epochs=1))  # the run's own data: the demo corpus, tokenized and packed
    from flexengine.data.corpus import build_corpus
    from flexengine.surgery.model import load_tokenizer

    lengths = build_corpus(job.data, load_tokenizer(job.model)).lengths
    assert demo.rows == plan_packing(lengths, 256, job.data.packing, job.data.long_docs).stats.rows
    assert not wants_corpus_time(PlanOptions()) and wants_corpus_time(PlanOptions(epochs=1))


def test_bad_corpus_options_name_the_key():
    job = compose_job(["debug=fast"])
    with pytest.raises(UserError, match="plan.documents needs plan.doc_tokens"):
        corpus_of(job, PlanOptions(documents=10))
    with pytest.raises(UserError, match="plan.epochs=0"):
        corpus_of(job, PlanOptions(epochs=0, tokens=10))
    with pytest.raises(UserError, match="give model.path .* plan.tokens=N"):
        corpus_of(compose_job(["data=jsonl", "data.path=/nowhere.jsonl"]), PlanOptions(epochs=1))
