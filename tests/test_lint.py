"""ruff (configured in pyproject.toml) finds nothing and would reformat nothing: the checks CI runs before the tests;
mypy finds no type error; and no process history is left in the text."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str | None:
    """A tool next to this interpreter (the project's venv), else one on PATH."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.is_file() else shutil.which(name)


@pytest.mark.lint  # cold (CI's fresh clone) ~40 s of one core, mostly reading torch's annotations; ~2 s cached
def test_mypy_clean():
    """mypy over flexengine/ as configured in pyproject.toml ([tool.mypy]: the modules not yet clean are listed
    there, every other one is checked, untyped function bodies included)."""
    mypy = _tool("mypy")
    if mypy is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run([mypy], cwd=REPO, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, f"mypy found problems (configured in pyproject.toml):\n{proc.stdout}{proc.stderr}"


@pytest.mark.lint
def test_ruff_clean():
    ruff = _tool("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run(
        [ruff, "check", "--output-format", "concise", str(REPO)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"ruff check found problems (fix them or `ruff check --fix`):\n{proc.stdout}"


@pytest.mark.lint
def test_ruff_format_clean():
    ruff = _tool("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run([ruff, "format", "--check", str(REPO)], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"files ruff would reformat (run `ruff format .`):\n{proc.stdout}"


# Process history lives in git, not in the text: no "issue <n>" or "review <n> #<m>", no finding labels ("F-<n>"),
# no case named after the issue it came from, and no bare "#<n>" unless another project's tracker is named before
# it ("torchtitan #<n>"). Say what the code does and why, never which turn changed it.
HISTORY_SCOPE = ("flexengine", "conf", "docs", "tests", "bench", "scripts", "README.md", "pyproject.toml")
HISTORY_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt"}
HISTORY = re.compile(
    r"\b(?:issue|review)s?\s*#?\d+(?:\s*#\d+)?|(?-i:\b[FR]-\d+\b)|\bthe (?:issue|review)'s\b", re.IGNORECASE
)
BARE_NUMBER = re.compile(r"(\S*)\s*(?<![\w/\"'`])#\d+\b")  # the word before it, and the number (not in a name)
EXTERNAL_TRACKERS = {
    "accelerate",
    "attention-gym",
    "axolotl",
    "datasets",
    "deepspeed",
    "flash-attention",
    "hydra",
    "litgpt",
    "nanochat",
    "nccl",
    "peft",
    "pytorch",
    "safetensors",
    "tokenizers",
    "torch",
    "torchao",
    "torchtitan",
    "torchtune",
    "transformers",
    "triton",
    "trl",
    "vllm",
}


def history_references(text: str) -> list[str]:
    """The process-history references in one text, as the matched words."""
    found = [m.group(0) for m in HISTORY.finditer(text)]
    for m in BARE_NUMBER.finditer(HISTORY.sub(" ", text)):  # a number an issue reference holds is counted once
        if m.group(1).strip("([{,;:").lower() not in EXTERNAL_TRACKERS:
            found.append(m.group(0).strip())
    return found


def test_no_issue_or_review_numbers_in_code_docs_or_tests():
    offenders = []
    for root in HISTORY_SCOPE:
        base = REPO / root
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.suffix in HISTORY_SUFFIXES)
        for path in paths:
            if "results" in path.relative_to(REPO).parts:  # bench/results: measurements the scripts write
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                offenders += [f"{path.relative_to(REPO)}:{n}: {ref}" for ref in history_references(line)]
    assert not offenders, (
        "process history in the text (it belongs in git): say what the code does and why instead:\n"
        + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    ("text", "found"),
    [
        (f"memory (issue {21}: small rooms)", [f"issue {21}"]),
        (f"a default (review {22} #{9}).", [f"review {22} #{9}"]),
        (f"counted as before (Issue #{16})", [f"Issue #{16}"]),
        (f"# -- a signal during evaluation (F-{10}) --", [f"F-{10}"]),
        ("the issue" + "'s case: a 6-step run", ["the issue" + "'s"]),
        (f"see #{16} for the numbers", [f"see #{16}"]),
        (f"flex must be saved (torchtitan #{1631}, pytorch #{151043}; TRL #{3910})", []),
        (f"axolotl #{3301} and transformers#{123} and ProfilerStep#{2}", []),
        (f'an unnamed parameter is called "#{1}"', []),
        ("issues are reported as one paragraph; review the plan", []),
    ],
)
def test_history_check_sees_each_form_and_spares_other_projects_trackers(text, found):
    assert history_references(text) == found
