"""`flexengine-stats` / `python -m flexengine.stats` (flexengine/cli/stats.py): the report on stdout, its JSON and
PNG in the run directory, and a bad record as one clean error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from flexengine.data.demo import load_demo_tokenizer
from tests.helpers import hide_package

REPO = Path(__file__).resolve().parents[3]


def _env() -> dict:
    """The subprocess reuses this session's demo tokenizer (trained here first, once per session)."""
    cache = Path(os.environ["FLEXENGINE_CACHE"])  # tests/conftest.py points it at the session's cache
    load_demo_tokenizer(cache)
    return {**os.environ, "PYTHONPATH": str(REPO), "FLEXENGINE_CACHE": str(cache)}


def test_cli_prints_and_writes_json_and_png(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "x = 1\n" * int(n)}) + "\n" for n in rng.integers(1, 200, 40)))
    env = _env()
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


def test_the_histogram_is_drawn_or_the_line_says_which_extra_draws_it(tmp_path, monkeypatch):
    from flexengine.cli.stats import write_histogram

    lengths = np.array([5, 50, 500])
    assert write_histogram(lengths, 256, tmp_path / "a.png") == f"and {tmp_path / 'a.png'}"
    assert (tmp_path / "a.png").stat().st_size > 1000
    hide_package(monkeypatch, "matplotlib")
    said = write_histogram(lengths, 256, tmp_path / "b.png")
    assert said == "(no b.png: the histogram needs matplotlib, pip install 'flexengine[plots]')"
    assert not (tmp_path / "b.png").exists()


def test_cli_bad_record_is_a_clean_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{bad\n')
    env = _env()
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
