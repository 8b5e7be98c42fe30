"""Units of memory (flexengine/core/units.py): one binary GiB, defined once for the whole package."""

from __future__ import annotations

import re
from pathlib import Path

from flexengine.core.units import GiB

PACKAGE = Path(__file__).resolve().parents[2] / "flexengine"
# spellings of 2^30 a module might define its own GiB with
OWN_GIB = re.compile(r"2\s*\*\*\s*30\b|1\s*<<\s*30\b|1024\s*\*\*\s*3\b|\b1073741824\b")


def test_a_gib_is_binary():
    assert GiB == 1024 * 1024 * 1024  # what nvidia-smi, torch's allocator and /proc/meminfo count in, not 1e9


def test_no_other_module_defines_its_own_gib():
    others = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "units.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OWN_GIB.search(line.split("#")[0])
    ]
    assert not others, f"import GiB from flexengine.core.units instead of spelling 2**30: {others}"
    assert OWN_GIB.search("x = 2**30") and OWN_GIB.search("GB = 1 << 30") and not OWN_GIB.search("2**300")
