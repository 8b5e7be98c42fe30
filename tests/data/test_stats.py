"""The numbers behind `flexengine-stats` (flexengine/data/stats.py): percentiles, per-strategy costs, context
coverage. The command itself is tested in tests/integration/cli/test_stats.py."""

from __future__ import annotations

import numpy as np

from flexengine.data.packing import plan_packing
from flexengine.data.stats import compare_strategies, context_summary, format_context, format_report, length_summary


def test_length_summary_percentiles():
    lengths = np.arange(1, 101)
    s = length_summary(lengths)
    assert (s["documents"], s["tokens"], s["p0"], s["p50"], s["p100"]) == (100, 5050, 1, 50, 100)
    assert s["p90"] == 90 and s["mean"] == 50.5


def test_compare_strategies_reports_each_plan():
    lengths = np.random.default_rng(0).integers(10, 300, 200)
    results = {r["strategy"]: r for r in compare_strategies(lengths, 128, "truncate", micro_batch=4)}
    for strategy, r in results.items():
        assert r["rows"] == plan_packing(lengths, 128, strategy, "truncate").stats.rows
        assert r["documents_truncated"] == int((lengths > 128).sum())
    assert results["bfd"]["useful_token_fraction"] > results["greedy"]["useful_token_fraction"]
    short = np.random.default_rng(1).integers(10, 120, 200)  # no row is full, so batch widths vary
    none = compare_strategies(short, 128, micro_batch=4)[-1]
    # cutting batches to their longest row can only help; sorting by length (bucket) helps more
    assert none["useful_token_fraction"] < none["batched_useful_fraction"] <= none["bucketed_useful_fraction"]
    assert "bfd" in format_report(length_summary(lengths), list(results.values()), 128, 4)


def test_context_summary_against_trained_and_supported_context():
    lengths = np.array([100, 4096, 4096, 6000, 9000])
    c = context_summary(lengths, 4096, 8192)
    assert (c["documents_over_trained"], c["documents_over_supported"]) == (2, 1)
    assert c["tokens_past_trained"] == 1904 + 4904 and c["documents_within_trained"] == 0.6
    text = format_context(length_summary(lengths), c, "trained on 4096 positions")
    assert "60.0% of documents within 4096" in text and "p100=9000*" in text and "p50=4096 " in text
