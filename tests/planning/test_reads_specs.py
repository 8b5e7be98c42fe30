"""Code below the composition root reads resolved specs, never config strings.

Two scans of the source: the planner's costs and the FLOP counter compare no memory policy, granularity, attention
backend or precision name at all (like the `memory.policy == "offload" or memory.offload` the planner once repeated
in five places); and no module under flexengine/ outside cli/, run.py and core's config modules compares a config
field with a string (`job.parallel.reduce_every == "micro_batch"`, `x.hardware.device != "cpu"`), except the
functions in CONFIG_SUBJECTS, each with the reason its subject is the config itself."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import typing
from pathlib import Path

import pytest

from flexengine.core.config import JobConfig

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


# -- any config field compared with a string, anywhere below the composition root ------------------------------------
# where config strings are the subject: the entry points and the composition root, and core's schemas that check them
COMPOSITION_ROOT = ("cli/", "run.py", "core/config.py", "core/config_model.py", "core/config_data.py")
COMPOSITION_ROOT += ("core/config_checks.py", "core/config_keys.py", "core/config_record.py")
# JobConfig's groups and their fields: `<group>.<field>` anywhere in an attribute chain is a config value
_HINTS = typing.get_type_hints(JobConfig)
CONFIG_GROUPS = {
    f.name: {g.name for g in dataclasses.fields(_HINTS[f.name])}
    for f in dataclasses.fields(JobConfig)
    if dataclasses.is_dataclass(_HINTS[f.name])
}
# module:function -> why it may compare its config's strings. Resolvers turn a config into the value or spec
# below them; builders pick a component by its own group's name; data/ reads its own DataConfig (which files,
# which format: no spec exists for a data source yet).
CONFIG_SUBJECTS = {
    "surgery/memory/spec.py:block_memory_specs": "the resolver: memory.* -> one MemorySpec per block",
    "planning/activations.py:resolve_tiles": "the resolver of memory.tiled_mlp=auto into a tile size",
    "surgery/attention/job_rules.py:resolve_attention_rules": "resolves data.packing=auto (composition root only)",
    "planning/fit.py:plan_job": "the fit resolves precision=auto and memory=auto: the user's auto is its question",
    "planning/fit.py:_explicit_choices": "names the user's own key=value choices in the does-not-fit message",
    "loop/optim.py:build_optimizer": "a builder: optim.name / optim.impl pick the optimizer class",
    "loop/optim.py:schedule_problem": "a warning about the user's own optim.schedule",
    "loop/checkpointer.py:warn_schedule_change": "explains the user's train.resume_schedule choice on resume",
    "data/build.py:build_data": "refuses an unresolved data.packing=auto; packing=none rows are trimmed",
    "data/cache.py:cache_key_inputs": "data.source / data.format decide what the cache key must include",
    "data/corpus.py:tokenize_to_cache": "data.format picks the tokenizing path",
    "data/sources.py:_units": "data.source picks the reader",
    "data/sources.py:check_record": "data.format picks the record's required fields",
    "data/sources.py:iter_raw_docs": "data.source / data.format pick the reader",
    "data/sources.py:needed_column": "data.format names the column read",
    "data/sources.py:resolve_eval_split": "data.source=hf has named splits",
    "data/sources.py:source_files": "data.source picks the files",
    "data/sources.py:unused_eval_split": "data.source=hf has named splits",
    "data/split.py:held_out_without_overlap": "the resolver of data.eval_overlap=auto",
}


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"]; [] for anything else (a call, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _is_config_value(node: ast.AST) -> bool:
    """An attribute chain through the job (`job.`, `cfg.`, `self.job.`) or a config group's field (`x.hardware.device`,
    `memory.policy`)."""
    parts = _chain(node)
    if any(p in ("job", "cfg") for p in parts[:-1]):
        return True
    return any(group in CONFIG_GROUPS and field in CONFIG_GROUPS[group] for group, field in itertools.pairwise(parts))


def _is_string(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
    return bool(elts) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts)


def config_string_compares(source: str) -> list[tuple[str, str]]:
    """(function, compare) for every comparison of a config value with a string constant (or a tuple of them)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_is_config_value, operands)) and any(map(_is_string, operands)):
                found.append((function, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def below_the_root() -> dict[str, str]:
    """Every package module outside the composition root: its path under flexengine/ -> its source."""
    modules = {p.relative_to(PACKAGE).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {rel: p.read_text(encoding="utf-8") for rel, p in modules.items() if not rel.startswith(COMPOSITION_ROOT)}


def test_the_wide_scan_finds_config_strings_compared():
    trainer = 'def step(self):\n    return self.job.parallel.reduce_every == "micro_batch"\n'
    assert config_string_compares(trainer) == [("step", "self.job.parallel.reduce_every == 'micro_batch'")]
    shapes = 'def plan_inputs(job):\n    return job.parallel.strategy == "fsdp"\n'
    assert config_string_compares(shapes) == [("plan_inputs", "job.parallel.strategy == 'fsdp'")]
    assert config_string_compares('def f(x):\n    return x.hardware.device != "cpu"\n')
    assert config_string_compares('def f(memory):\n    return memory.policy in ("full", "selective")\n')
    assert config_string_compares('def f(cfg):\n    return "flex" == cfg.attn.backend\n')
    # resolved values, plan rows and plain names are not config fields
    assert not config_string_compares("def f(spec):\n    return spec.backend is AttnBackend.FLEX\n")
    assert not config_string_compares('def f(row):\n    return row["reduce_every"] != "window"\n')
    assert not config_string_compares('def f(strategy):\n    return strategy == "bfd"\n')
    assert not config_string_compares('def f(x):\n    return x.precision == "fp32"\n')  # not a group field chain


def test_no_config_string_is_compared_below_the_composition_root():
    found = {
        f"{rel}:{function}": compare
        for rel, source in below_the_root().items()
        for function, compare in config_string_compares(source)
    }
    unexplained = sorted(f"{where}: {compare}" for where, compare in found.items() if where not in CONFIG_SUBJECTS)
    assert not unexplained, (
        "config strings compared below the composition root: resolve them once there (an enum or a spec, as "
        "core/parallel_spec.py and surgery/attention/spec.py do) and compare the resolved value, or add the "
        "function to CONFIG_SUBJECTS with the reason its subject is the config itself:\n" + "\n".join(unexplained)
    )
    assert not sorted(set(CONFIG_SUBJECTS) - set(found)), "CONFIG_SUBJECTS lists functions that compare no string"
