"""loop/metrics.py's writers on their own: a link where metrics.jsonl or the TensorBoard folder goes is refused, and
nothing is written through it (what a real run logs: tests/integration/loop/test_metrics.py)."""

from __future__ import annotations

import pytest

from flexengine.loop import metrics


def test_a_symlinked_metrics_file_is_never_written_through(tmp_path):
    """Before: metrics.jsonl was opened with "a" and rewritten by truncate_after through any link."""
    target = tmp_path / "precious.txt"
    target.write_text('{"step": 9}\n')
    (tmp_path / "metrics.jsonl").symlink_to(target)
    writer = metrics.MetricsWriter(None, tmp_path / "metrics.jsonl")
    from flexengine.core.errors import UserError

    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link"):
        writer.record({"type": "train", "step": 1})
    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link"):
        writer.truncate_after(0)
    assert target.read_text() == '{"step": 9}\n'


def test_a_symlinked_tensorboard_dir_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "tb").symlink_to(elsewhere)
    from flexengine.core.errors import UserError

    writer = metrics.MetricsWriter(tmp_path / "tb", None)
    with pytest.raises(UserError, match="tb is a symbolic link"):
        writer.scalars({"loss": 1.0}, 1)
    assert not list(elsewhere.iterdir())
