"""The planner's costs and the FLOP counter read resolved specs (MemorySpec per block, AttnBackend), never config
strings: a scan of the source for comparisons against a memory policy, granularity or attention backend name, like the
`memory.policy == "offload" or memory.offload` the planner once repeated in five places."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flexengine"
SCANNED = sorted((PACKAGE / "planning").glob("*.py")) + [PACKAGE / "loop" / "flops.py"]
# memory.policy, memory.granularity and attn.backend values (core/config.py's choice lists)
CONFIG_NAMES = {"none", "full", "selective", "offload", "block", "attention", "mlp", "ops", "flex", "dense", "varlen"}
# optim.name and precision.mode values: what a mode stores is PrecisionSpec's answer (bytes_per_param, fsdp_dtypes)
CONFIG_NAMES |= {"adamw", "adamw_8bit", "adamw_bf16", "adamw_cpu_offload", "fp32", "bf16_mixed", "bf16_sr"}
CONFIG_NAMES |= {"bf16_cpu_master", "bf16_pure"}
# Functions that build MemoryConfigs or write them back as overrides for the user: config is their subject.
CONFIG_WRITERS = {"search_space", "candidates_for", "_overrides"}
# memory.* fields a plan row repeats as strings (row["memory"]): a read of one is a config-string dispatch too
MEMORY_FIELDS = {"granularity", "tiled_mlp", "offload"}


def string_compares(source: str) -> list[str]:
    """`x == "offload"`, `x in ("full", "selective")`, ... outside CONFIG_WRITERS, as 'function: line'."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Compare) and function not in CONFIG_WRITERS:
            operands = [node.left, *node.comparators]
            names = {
                c.value
                for op in operands
                for c in ast.walk(op)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
            if names & CONFIG_NAMES:
                found.append(f"{function}: {ast.unparse(node)}")
        if isinstance(node, ast.Subscript) and function not in CONFIG_WRITERS and _reads_memory_config(node):
            found.append(f"{function}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def _reads_memory_config(node: ast.Subscript) -> bool:
    """`row["memory"]["policy"]`, `mem["granularity"]`: a memory config field read by its string key."""

    def key(n: ast.AST) -> object:
        return n.slice.value if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) else None

    return key(node) in MEMORY_FIELDS or key(node.value) == "memory"


def test_the_scan_finds_what_the_planner_once_wrote():
    old = 'def _offloads(memory):\n    return memory.policy == "offload" or bool(memory.offload)\n'
    assert string_compares(old) == ["_offloads: memory.policy == 'offload'"]
    assert string_compares('def f(w):\n    return w.backend in ("flex", "dense")\n')
    assert not string_compares('def search_space(m):\n    return m.policy == "full"\n')
    # the ranking once read the row's memory config by key (a plain-offload row ranked as "block" by its default)
    rank = 'def _rank(row):\n    return bool(row["memory"]["tiled_mlp"]), G.index(row["memory"]["granularity"])\n'
    assert string_compares(rank) == [
        "_rank: row['memory']['tiled_mlp']",
        "_rank: row['memory']['granularity']",
    ]
    assert not string_compares('def _rank(row):\n    return row["k"], plan["policy"], MemoryConfig(**row["memory"])\n')


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: p.name)
def test_costs_compare_no_config_strings(path):
    assert not string_compares(path.read_text(encoding="utf-8")), (
        f"{path.name} compares config strings: read the MemorySpec / AttnBackend / PrecisionSpec instead"
    )
