"""ruff (configured in pyproject.toml) finds nothing and would reformat nothing: the checks CI runs before the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ruff() -> str | None:
    """The ruff next to this interpreter (the project's venv), else one on PATH."""
    here = Path(sys.executable).with_name("ruff")
    return str(here) if here.is_file() else shutil.which("ruff")


def test_ruff_clean():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run(
        [ruff, "check", "--no-cache", "--output-format", "concise", str(REPO)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"ruff check found problems (fix them or `ruff check --fix`):\n{proc.stdout}"


def test_ruff_format_clean():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run(
        [ruff, "format", "--check", "--no-cache", str(REPO)], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, f"files ruff would reformat (run `ruff format .`):\n{proc.stdout}"
