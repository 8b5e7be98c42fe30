"""`python -m flexengine.stats`: percentiles, per-strategy costs, and the CLI's JSON + PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from flexengine.data.packing import plan_packing
from flexengine.data.stats import compare_strategies, context_summary, format_context, format_report, length_summary

REPO = Path(__file__).resolve().parents[2]


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


def test_cli_prints_and_writes_json_and_png(tmp_path, write_jsonl, demo_tokenizer, cache_root):
    rng = np.random.default_rng(0)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "x = 1\n" * int(n)} for n in rng.integers(1, 200, 40)])
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLEXENGINE_CACHE": str(cache_root)}  # demo tokenizer reused
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexengine.stats",
            "data=jsonl",
            f"data.path={path}",
            "data.seq_len=256",
            "model.arch.max_position_embeddings=512",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "length percentiles" in out.stdout and "bfd" in out.stdout and "greedy" in out.stdout
    report = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    assert report["lengths"]["documents"] == 40 and report["seq_len"] == 256
    assert [s["strategy"] for s in report["strategies"]] == ["bfd", "greedy", "none"]
    assert "context: model trained on 512 positions" in out.stdout
    over = report["context"]["documents_over_trained"]
    assert report["context"]["trained_context"] == 512 and 0 < over < 40  # docs of 4..800 tokens
    assert report["context"]["documents_within_trained"] == (40 - over) / 40
    assert (tmp_path / "run" / "data_stats.png").stat().st_size > 1000


def test_cli_bad_record_is_a_clean_error(tmp_path, write_lines, demo_tokenizer, cache_root):
    path = write_lines(tmp_path / "d.jsonl", ['{"text": "a"}', "{bad"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLEXENGINE_CACHE": str(cache_root)}  # demo tokenizer reused
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexengine.stats",
            "data=jsonl",
            f"data.path={path}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 2 and f"{path}:2: not valid JSON" in out.stderr and "Traceback" not in out.stderr
