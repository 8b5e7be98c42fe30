"""Code below the composition root reads resolved specs, never config strings.

Two scans of the source: the planner's costs and the FLOP counter compare no memory policy, granularity, attention
backend or precision name at all (like the `memory.policy == "offload" or memory.offload` the planner once repeated
in five places); and no module under flexengine/ outside cli/, run.py and core's config modules compares any value
with a string that is one of the config's choices (`==`, `!=`, `in`, `not in`, `match` cases), whatever the compared
value is called (`s = job.parallel.strategy; s == "fsdp"`), except the functions in CONFIG_SUBJECTS, each with its
reason. The choices are collected from what the config validates against (`config_choices`)."""

from __future__ import annotations

import ast
import importlib
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


# -- any config choice compared as a string, anywhere below the composition root ---------------------------------------
# where config strings are the subject: the entry points and the composition root, and core's schemas that check them
COMPOSITION_ROOT = ("cli/", "run.py", "resolve.py", "core/config.py", "core/config_model.py", "core/config_data.py")
COMPOSITION_ROOT += ("core/config_checks.py", "core/config_keys.py", "core/config_record.py")


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def config_choices() -> frozenset[str]:
    """Every value a config choice may take: what each `check_choice(key, value, choices)` call in the package
    validates against (evaluated in its own module: core's choice lists, `tuple(MODES)`, the precision group's
    options), the tables and enums the choices name (MODES, SPECS, KINDS, Strategy, ReduceEvery, AttnBackend), and
    the option names of every conf/ group."""
    from flexengine.core.parallel_spec import ReduceEvery, Strategy
    from flexengine.surgery.attention.masks import MODES
    from flexengine.surgery.attention.spec import AttnBackend
    from flexengine.surgery.memory.kinds import KINDS
    from flexengine.surgery.precision import SPECS

    values = {*MODES, *SPECS, *KINDS} | {e.value for enum in (Strategy, ReduceEvery, AttnBackend) for e in enum}
    values |= {p.stem for p in (PACKAGE.parent / "conf").glob("*/*.yaml")}
    for path in sorted(PACKAGE.rglob("*.py")):
        calls = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.Call)]
        for call in calls:
            if isinstance(call.func, ast.Name) and call.func.id == "check_choice" and len(call.args) == 3:
                choices = eval(ast.unparse(call.args[2]), vars(importlib.import_module(_module_of(path))))
                values |= {v for v in choices if isinstance(v, str)}
    return frozenset(values)


# module:function -> why it may compare a config choice's string. Resolvers turn a config into the value or spec
# below them; builders pick a component by its own group's name; data/ reads its own DataConfig (which files:
# no spec exists for a data source yet; a data format is a core/data_formats.py entry). A string that only looks
# like a choice says what it is instead.
CONFIG_SUBJECTS: dict[str, str] = {
    "core/distributed.py:init_distributed": "resolves parallel.backend=auto by the torch.device type",
    "core/distributed.py:rank_device": "torch.device.type, not a config value",
    "core/device_speed.py:measure_device_speed": "torch.device.type, not a config value",
    "core/memory_policies.py:tiles_mlp": "a composition check of memory.* (and the search that writes memory.*)",
    "core/hardware.py:resolve_device": "the resolver of hardware.device=auto",
    "core/hardware.py:resolve_hardware": "the resolver of hardware=auto (and a torch.device type)",
    "core/storage.py:_in_use_message": "explains the user's own train.resume=auto",
    "core/storage.py:check_output_dir": "the resolver of train.resume=auto against the output directory",
    "data/build.py:build_data": "refuses an unresolved data.packing=auto; packing=none rows are trimmed",
    "data/cache.py:cache_key_inputs": "data.source=hf: a saved DatasetDict's split is part of the cache key",
    "data/corpus.py:tokenize_to_cache": "data.source=demo knows its document count (the progress bar's total)",
    "data/encode.py:_chat_ids_and_mask": "the encoder's resolved mask source, still a data.assistant_mask string",
    "data/encode.py:__init__": "resolves data.train_on / assistant_mask=auto into the encoder's mask source",
    "data/encode.py:encode_chat": "data.long_chats / train_on: no data spec exists yet",
    "data/encode.py:assistant_char_spans": "a chat turn's role, not data.train_on",
    "data/encode.py:describe_mask": "the encoder's resolved mask source, for the log",
    "data/packing.py:_pieces": "data.long_docs: no data spec exists yet",
    "data/packing.py:plan_packing": "data.packing picks the packer: no data spec exists yet",
    "data/sources.py:_units": "data.source picks the reader",
    "data/sources.py:check_chat_messages": "a chat turn's role, not data.train_on",
    "data/sources.py:report": "data.on_error: raise or count",
    "data/sources.py:resolve_eval_split": "data.source=hf has named splits",
    "data/sources.py:source_files": "data.source picks the files",
    "data/sources.py:unused_eval_split": "data.source=hf has named splits",
    "data/split.py:held_out_without_overlap": "the resolver of data.eval_overlap=auto",
    "data/stats.py:compare_strategies": "the stats command compares the packing strategies by name",
    "loop/checkpoint/load.py:pick": "the resolver of train.resume=auto into a checkpoint path",
    "loop/checkpointer.py:_set_rng_state": "a saved RNG state's device key ('cuda'), not a config value",
    "loop/checkpointer.py:warn_schedule_change": "explains the user's own train.resume_schedule choice on resume",
    "loop/metrics.py:allocator_stats": "torch.device.type, not a config value",
    "loop/metrics.py:peak_memory_bytes": "torch.device.type, not a config value",
    "loop/optim.py:_transformers_scheduler": "a builder: optim.schedule picks the schedule function",
    "loop/optim.py:build_adamw": "a builder: optim.impl picks torch AdamW's implementation (fused on CUDA)",
    "loop/optim.py:resumed_knots": "train.resume_schedule: rederive or keep the saved knots",
    "loop/optim.py:schedule_problem": "a warning about the user's own optim.schedule",
    "loop/profiling.py:start_profiler": "torch.device.type, not a config value",
    "loop/profiling.py:top_ops_table": "torch.device.type, not a config value",
    "loop/trainer.py:sync_device": "torch.device.type, not a config value",
    "planning/activations.py:resolve_tiles": "the resolver of memory.tiled_mlp=auto into a tile size",
    "planning/fit.py:_explicit_choices": "names the user's own key=value choices in the does-not-fit message",
    "planning/fit.py:plan_job": "the fit resolves precision=auto and memory=auto: the user's auto is its question",
    "planning/planner.py:candidates_for": "builds MemoryConfig candidates: the search space is memory.* itself",
    "planning/planner.py:search_space": "builds MemoryConfig candidates: the search space is memory.* itself",
    "surgery/attention/block_mask.py:_create_block_mask": "torch.device.type, not a config value",
    "surgery/attention/job_rules.py:resolve_attention_rules": "resolves data.packing=auto (composition root only)",
    "surgery/attention/spec.py:resolve_backend": "the resolver of attn.backend=auto into an AttnBackend",
    "surgery/memory/layers.py:select_layers": "the resolver of memory.layers into layer indices",
    "surgery/memory/offload.py:_streams_for": "torch.device.type, not a config value",
    "surgery/memory/spec.py:block_memory_specs": "the resolver: memory.* -> one MemorySpec per block",
    "surgery/parallel.py:apply_parallel": "torch.device.type, not a config value",
    "surgery/precision.py:_accepted_optimizers": "optim.name's default, adamw, is what other optimizers stand in for",
    "surgery/precision.py:auto_order": "the resolver of precision=auto: its order depends on optim.name",
    "surgery/precision.py:fsdp_policy": "torch.device.type, not a config value",
    "surgery/precision.py:precision_spec": "the resolver of precision.mode + optim.name into a PrecisionSpec",
    "surgery/rope.py:apply_rope_scaling": "the resolver of model.rope_scaling against HF's rope_type",
    "surgery/rope.py:context_limits": "HF's rope_type of the model config, not a choice of ours",
    "surgery/rope.py:describe": "HF's rope_type of the model config, for the log",
    "core/device_speed.py:_copy_gb_s": "torch.device.type, not a config value",
    "core/device_speed.py:_measurements": "torch.device.type, not a config value",
    "core/device_speed.py:_sync": "torch.device.type, not a config value",
    "core/device_speed.py:device_key": "torch.device.type, not a config value",
    "core/device_speed.py:release_measurement": "torch.device.type, not a config value",
    "planning/max_seq_len.py:longest_over_modes": "precision=auto: the search weighs every mode; a set mode alone",
    "surgery/compile.py:why_uncompiled": "torch.compiler's stance, not a config value",
}


def _constants(node: ast.AST) -> set[str]:
    """A str constant, or the str constants of a tuple/list/set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def _pattern_constants(pattern: ast.AST) -> set[str]:
    """The str constants a `case` pattern matches (`case "a"`, `case "a" | "b"`)."""
    return {
        n.value.value
        for n in ast.walk(pattern)
        if isinstance(n, ast.MatchValue) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
    }


def config_string_compares(source: str, choices: frozenset[str]) -> list[tuple[str, str]]:
    """(function, comparison) for every `==`, `!=`, `in`, `not in` and `match` case whose str constant is a config
    choice, whatever the compared value is called."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Compare) and any(_constants(op) & choices for op in [node.left, *node.comparators]):
            found.append((function, ast.unparse(node)))
        if isinstance(node, ast.match_case) and _pattern_constants(node.pattern) & choices:
            found.append((function, f"case {ast.unparse(node.pattern)}"))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def below_the_root() -> dict[str, str]:
    """Every package module outside the composition root: its path under flexengine/ -> its source."""
    modules = {p.relative_to(PACKAGE).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {rel: p.read_text(encoding="utf-8") for rel, p in modules.items() if not rel.startswith(COMPOSITION_ROOT)}


def test_config_choices_are_what_the_config_validates():
    choices = config_choices()
    assert {"fsdp", "micro_batch", "offload", "ops", "packed_sliding", "bf16_sr", "cuda", "bfd", "hf"} <= choices
    assert {"adamw_cpu_offload", "warmup_stable_decay", "a100_80g", "template", "nccl"} <= choices


def test_the_wide_scan_finds_config_strings_however_they_are_reached():
    choices = frozenset({"fsdp", "micro_batch", "full", "selective", "packed_doc"})
    trainer = 'def step(self):\n    return self.job.parallel.reduce_every == "micro_batch"\n'
    assert config_string_compares(trainer, choices) == [("step", "self.job.parallel.reduce_every == 'micro_batch'")]
    alias = 'def f(job):\n    s = job.parallel.strategy\n    return s == "fsdp"\n'
    assert config_string_compares(alias, choices) == [("f", "s == 'fsdp'")]
    renamed = 'def f(given):\n    return given.policy in ("full", "selective")\n'
    assert config_string_compares(renamed, choices) == [("f", "given.policy in ('full', 'selective')")]
    getattr_ = 'def f(job):\n    return "fsdp" != getattr(job.parallel, "strategy")\n'
    assert config_string_compares(getattr_, choices) == [("f", "'fsdp' != getattr(job.parallel, 'strategy')")]
    carried = 'def f(spec):\n    return spec.mode not in {"packed_doc"}\n'
    assert config_string_compares(carried, choices) == [("f", "spec.mode not in {'packed_doc'}")]
    match = "def f(s):\n    match s:\n"
    match += '        case "fsdp" | "ddp":\n            return 1\n        case _:\n            return 0\n'
    assert config_string_compares(match, choices) == [("f", "case 'fsdp' | 'ddp'")]
    # resolved values and strings that are no choice pass
    assert not config_string_compares("def f(spec):\n    return spec.backend is AttnBackend.FLEX\n", choices)
    assert not config_string_compares('def f(row):\n    return row.kind == "grad_norm"\n', choices)


def test_no_config_string_is_compared_below_the_composition_root():
    choices = config_choices()
    found: dict[str, list[str]] = {}
    for rel, source in below_the_root().items():
        for function, compare in config_string_compares(source, choices):
            found.setdefault(f"{rel}:{function}", []).append(compare)
    unexplained = sorted(f"{where}: {'; '.join(c)}" for where, c in found.items() if where not in CONFIG_SUBJECTS)
    assert not unexplained, (
        "config strings compared below the composition root: resolve them once there (an enum or a spec, as "
        "core/parallel_spec.py and surgery/attention/spec.py do) and compare the resolved value, or add the "
        "function to CONFIG_SUBJECTS with the reason:\n" + "\n".join(unexplained)
    )
    assert not sorted(set(CONFIG_SUBJECTS) - set(found)), "CONFIG_SUBJECTS lists functions that compare no choice"
