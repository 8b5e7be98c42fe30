"""Checks on the package's shape that any reader can rerun: no import circle, no long positional parameter lists.

Both read the source with `ast` (nothing is imported), so they see imports inside functions too: a lazy import
that closes a circle is still a circle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flexengine"
MAX_POSITIONAL = 6  # past this, call sites read as a row of unlabeled values: take keyword-only args or a spec


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package` (a package's __init__ is the package)."""
    root = package.parent
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """Modules of ours that one import statement loads: `from a.b import c` is a.b.c if that is a module, else a.b."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:  # relative: resolved against this module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = {f"{target}.{alias.name}" for alias in node.names} & modules.keys()
    if target in modules and len(found) < len(node.names):  # some names are attributes of `target` itself
        found.add(target)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports anywhere in its source (module level or in a function)."""
    modules = module_files(package)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):
            deps |= _imported(node, name, path.name == "__init__.py", modules)
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, in sorted order so the answer is stable)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@dataclass
class Signature:
    where: str  # file:line function
    positional: int  # parameters that can be passed by position, self/cls not counted


def signatures(package: Path) -> list[Signature]:
    """Every function and method defined under `package`, with its count of positional parameters."""
    out = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.posonlyargs + node.args.args]
                if names[:1] in (["self"], ["cls"]):
                    names = names[1:]
                out.append(Signature(f"{path.relative_to(package.parent)}:{node.lineno} {node.name}", len(names)))
    return out


def _write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 20 and graph["flexengine.run"], "the walker found too little: is PACKAGE right?"
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import circle: " + " -> ".join(cycle) + ". Move the shared piece into the lower module (or a small one "
        "both import), so that imports point one way."
    )


def test_cycle_finder_sees_lazy_relative_and_package_cycles(tmp_path):
    # a lazy import inside a function closes the circle a -> b -> a
    lazy = _write_package(
        tmp_path / "lazy",
        {
            "__init__.py": "",
            "a.py": "from pkg.b import f\n",
            "b.py": "def f():\n    from pkg.a import g\n    return g\n",
        },
    )
    assert find_cycle(import_graph(lazy)) == ["pkg.a", "pkg.b", "pkg.a"]
    # relative imports, and a submodule importing a name its package __init__ re-exports from it
    rel = _write_package(
        tmp_path / "rel",
        {
            "__init__.py": "",
            "sub/__init__.py": "from .x import X\n",
            "sub/x.py": "X = 1\n",
            "sub/y.py": "from . import X\n",
            "z.py": "from .sub import y\n",
        },
    )
    graph = import_graph(rel)
    assert graph["pkg.sub.y"] == {"pkg.sub"} and graph["pkg.z"] == {"pkg.sub.y"}
    assert find_cycle(graph) is None
    (rel / "sub" / "x.py").write_text("from pkg.sub.y import X as Y\nX = 1\n")  # x -> y -> sub -> x
    assert find_cycle(import_graph(rel)) == ["pkg.sub", "pkg.sub.x", "pkg.sub.y", "pkg.sub"]


def test_no_function_takes_more_than_six_positional_parameters():
    found = signatures(PACKAGE)
    assert len(found) > 100, "the walker found too few functions: is PACKAGE right?"
    long = [f"{s.where}: {s.positional}" for s in found if s.positional > MAX_POSITIONAL]
    assert not long, (
        f"functions with more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only with `*,` "
        "or pass a spec / sub-config):\n" + "\n".join(long)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a, b, c, d, e, f, g): pass", 7),
        ("def f(a, b, /, c, *, d, e, f, g): pass", 3),  # keyword-only parameters are free
        ("class C:\n    def m(self, a, b, *args, **kw): pass", 2),  # self and *args/**kwargs not counted
    ],
)
def test_signature_counter(tmp_path, source, expected):
    pkg = _write_package(tmp_path, {"__init__.py": "", "m.py": source + "\n"})
    assert [s.positional for s in signatures(pkg)] == [expected]


def test_tests_import_helpers_not_conftest():
    tests = Path(__file__).resolve().parent
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(n.split(".")[-1] == "conftest" for n in names):
                offenders.append(f"{path.relative_to(tests.parent)}:{node.lineno}")
    assert not offenders, "import shared helpers from tests.helpers (conftest is for fixtures): " + ", ".join(offenders)


# The folders are the layers (docs/architecture.md draws this picture). A module's layer is its first folder under
# flexengine/; the few top-level modules are named here. Imports run downward only: an arrow not listed is forbidden.
LAYER_OF_TOP_LEVEL = {
    "flexengine": "core",  # the package's lazy public API: imports nothing of ours at module level
    "flexengine.conf": "core",
    "flexengine.__main__": "cli",
    "flexengine.train": "cli",  # `python -m flexengine.<command>` shims, kept for users
    "flexengine.plan": "cli",
    "flexengine.doctor": "cli",
    "flexengine.sweep": "cli",
    "flexengine.stats": "cli",
    "flexengine.run": "run",
    "flexengine.resolve": "run",  # the one resolution sequence, beside the composition root that runs it
}
ALLOWED = {
    "cli": {"cli", "run", "loop", "surgery", "planning", "data", "core"},
    "run": {"run", "loop", "surgery", "planning", "data", "core"},
    "loop": {"loop", "surgery", "data", "core"},  # the loop reads surgery's and data's public specs
    "planning": {"planning", "surgery", "core"},  # costs are read from surgery's resolved specs
    "surgery": {"surgery", "data", "core"},  # surgery reads the batch contract data defines (IGNORE_INDEX, targets)
    "data": {"data", "core"},
    "core": {"core"},
}


def layer_of(module: str) -> str:
    """The layer a module belongs to: its folder under flexengine/, or the table above for top-level modules."""
    if module in LAYER_OF_TOP_LEVEL:
        return LAYER_OF_TOP_LEVEL[module]
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in ALLOWED:  # a layer package itself (its __init__) is in its layer
        raise AssertionError(f"{module} sits in no layer: put it in one of {sorted(ALLOWED)}/ (or name it above)")
    return parts[1]


def forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up or sideways in the layer picture, as 'a (layer) -> b (layer)'."""
    out = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps - {"flexengine"}):  # the root package is loaded on the way to any submodule
            src, dst = layer_of(module), layer_of(dep)
            if dst not in ALLOWED[src]:
                out.append(f"{module} ({src}) -> {dep} ({dst})")
    return out


def test_imports_run_down_the_layers():
    arrows = forbidden_arrows(import_graph(PACKAGE))
    assert not arrows, (
        "imports that break the layer picture (docs/architecture.md): move the shared piece down into the lower "
        "layer, or have run.py pass it in:\n" + "\n".join(arrows)
    )


def test_layer_check_catches_an_upward_import(tmp_path):
    pkg = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/config.py": "",
            "data/__init__.py": "",
            "data/loader.py": "def f():\n    from pkg.loop.loss import g\n",  # data -> loop, lazily: forbidden
            "loop/__init__.py": "",
            "loop/loss.py": "from pkg.core.config import X\n",  # loop -> core: allowed
        },
    )
    renamed = {
        m.replace("pkg", "flexengine", 1): {d.replace("pkg", "flexengine", 1) for d in deps}
        for m, deps in import_graph(pkg).items()
    }
    assert forbidden_arrows(renamed) == ["flexengine.data.loader (data) -> flexengine.loop.loss (loop)"]
    with pytest.raises(AssertionError, match="sits in no layer"):
        layer_of("flexengine.misc.helper")


# The job stops at the composition root (run.py, resolve.py, cli/): below it a module takes its own config sections,
# specs and plain values, never the whole JobConfig. planning/fit.py alone reads one: the fit plans a job's variants.
BELOW_THE_ROOT = ("loop", "surgery", "planning", "data")
JOB_READERS = {"planning/fit.py"}


def job_importers(package: Path) -> list[str]:
    """Modules under BELOW_THE_ROOT, but JOB_READERS, that import JobConfig, reach it as an attribute
    (`config.JobConfig`) or take a parameter named `job`, anywhere in their source (a lazy or TYPE_CHECKING import
    is an import too)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.split("/")[0] not in BELOW_THE_ROOT or rel in JOB_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            imported = isinstance(node, ast.ImportFrom) and any(a.name == "JobConfig" for a in node.names)
            handed = isinstance(node, ast.arg) and node.arg == "job"  # untyped, or a string annotation
            if imported or handed or (isinstance(node, ast.Attribute) and node.attr == "JobConfig"):
                found.append(rel)
                break
    return found


def test_no_module_below_the_root_imports_the_job():
    found = job_importers(PACKAGE)
    assert not found, (
        "modules below the composition root that import JobConfig: take the config sections (AttnConfig, "
        "DataConfig, ...), specs or plain values they read, or a callable built in flexengine/resolve.py:\n"
        + "\n".join(found)
    )


def test_job_check_sees_imports_and_attributes_below_the_root_only(tmp_path):
    job = "from pkg.core.config import JobConfig\n"
    package = _write_package(
        tmp_path,
        {
            "run.py": job,
            "resolve.py": job,
            "cli/plan.py": job,
            "planning/fit.py": job,  # the one reader below the root
            "planning/costs.py": "from pkg.core.config import HardwareConfig\n",
            "loop/trainer.py": f"def f():\n    {job}",  # lazily
            "surgery/lora.py": "from pkg.core import config\n\n\ndef f(job: config.JobConfig) -> None:\n    pass\n",
            "data/build.py": f"from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    {job}",
            "data/loader.py": "def f(job: 'JobConfig') -> None:\n    pass\n",  # handed one, never imported
        },
    )
    assert job_importers(package) == ["data/build.py", "data/loader.py", "loop/trainer.py", "surgery/lora.py"]


MAX_FILE_LINES = 500  # small rooms: a file a reader holds in mind at once
MAX_FUNCTION_LINES = 60


def oversized(package: Path) -> list[str]:
    """Files over MAX_FILE_LINES and functions (methods, nested functions) over MAX_FUNCTION_LINES, as 'where: n'."""
    found = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        name = path.relative_to(package)
        if len(source.splitlines()) > MAX_FILE_LINES:
            found.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_file_over_500_lines_and_no_function_over_60():
    assert not oversized(PACKAGE), oversized(PACKAGE)


def test_size_check_sees_a_long_file_and_a_long_method(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    package = _write_package(
        tmp_path,
        {
            "long.py": "\n" * MAX_FILE_LINES + "x = 1\n",
            "method.py": f"class A:\n    def f(self):\n{body}\n        return 0\n",
            "fine.py": "def g():\n    return 1\n",
        },
    )
    assert sorted(oversized(package)) == ["long.py: 501 lines", "method.py:2 f: 62 lines"]


# Components own their state: the trainer's private fields are written in loop/trainer.py only. A function elsewhere
# that writes `trainer._x` is a method in exile: give the state to the component that owns it.
TRAINER_MODULE = "loop/trainer.py"


def _names_of_trainers(tree: ast.AST) -> set[str]:
    """`trainer`, and every parameter annotated Trainer (`t: Trainer`, `t: "Trainer"`, `t: trainer.Trainer`)."""
    names = {"trainer"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            note = node.annotation
            text = note.value if isinstance(note, ast.Constant) and isinstance(note.value, str) else None
            if text == "Trainer" or getattr(note, "id", None) == "Trainer" or getattr(note, "attr", None) == "Trainer":
                names.add(node.arg)
    return names


def _is_trainer(node: ast.AST, names: set[str]) -> bool:
    """A name bound to a trainer, or `<anything>.trainer` (a component holding one)."""
    return (isinstance(node, ast.Name) and node.id in names) or (
        isinstance(node, ast.Attribute) and node.attr == "trainer"
    )


def _assigned(node: ast.AST) -> list[ast.AST]:
    """The targets one statement assigns, tuples and lists unpacked."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    out = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        else:
            out.append(target)
    return out


def private_trainer_writes(package: Path) -> list[str]:
    """Every write of a trainer's private field outside loop/trainer.py, as 'file:line trainer._x': assignments
    (plain, augmented, annotated, unpacked) and setattr(trainer, "_x", ...)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if name == TRAINER_MODULE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        trainers = _names_of_trainers(tree)
        for node in ast.walk(tree):
            for target in _assigned(node):
                private = isinstance(target, ast.Attribute) and target.attr.startswith("_")
                if private and _is_trainer(target.value, trainers):
                    found.append(f"{name}:{node.lineno} {ast.unparse(target)}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) >= 2:
                obj, attr = node.args[0], node.args[1]
                if _is_trainer(obj, trainers) and isinstance(attr, ast.Constant) and str(attr.value).startswith("_"):
                    found.append(f"{name}:{node.lineno} setattr({ast.unparse(obj)}, {attr.value!r})")
    return found


def test_only_the_trainer_writes_its_private_fields():
    assert (PACKAGE / TRAINER_MODULE).is_file(), "the trainer moved: update TRAINER_MODULE"
    writes = private_trainer_writes(PACKAGE)
    assert not writes, (
        "these modules write the trainer's private fields (a function that writes trainer._x is a method in exile: "
        "move the state into the component that owns it, or the code into loop/trainer.py):\n" + "\n".join(writes)
    )


# The components hold what they need from construction (loop/components.py): none is handed the trainer at call time.
COMPONENT_MODULES = ("loop/checkpointer.py", "loop/evaluator.py", "loop/progress.py", "loop/components.py")


def trainer_parameters(package: Path, modules: tuple[str, ...]) -> list[str]:
    """Every function or method of `modules` with a parameter named trainer or annotated Trainer, as
    'file:line function(parameter)'."""
    found = []
    for name in modules:
        tree = ast.parse((package / name).read_text(encoding="utf-8"))
        trainers = _names_of_trainers(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                every = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                found += [f"{name}:{node.lineno} {node.name}({a.arg})" for a in every if a.arg in trainers]
    return found


def test_the_components_are_never_handed_the_trainer():
    for name in COMPONENT_MODULES:
        assert (PACKAGE / name).is_file(), f"{name} moved: update COMPONENT_MODULES"
    found = trainer_parameters(PACKAGE, COMPONENT_MODULES)
    assert not found, (
        "these component functions take the trainer (hand the component what it needs when it is built, in "
        "loop/components.py):\n" + "\n".join(found)
    )


def test_trainer_parameter_check_sees_names_and_annotations(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "loop/evaluator.py": (
                "class E:\n"
                "    def evaluate(self, trainer):\n        pass\n"
                "    def sample(self, t: 'Trainer', *, step: int):\n        pass\n"
                "    def fine(self, step: int):\n        pass\n"
                "def summary(run: Trainer):\n    pass\n"
            ),
        },
    )
    assert sorted(trainer_parameters(package, ("loop/evaluator.py",))) == [
        "loop/evaluator.py:2 evaluate(trainer)",
        "loop/evaluator.py:4 sample(t)",
        "loop/evaluator.py:8 summary(run)",
    ]


def test_private_write_check_sees_every_form(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "loop/trainer.py": "class Trainer:\n    def f(self, trainer):\n        self._a = trainer._b = 1\n",
            "loop/evaluator.py": (
                "def f(trainer, t: 'Trainer', u: Trainer):\n"
                "    trainer._a = 1\n"
                "    t._b += 1\n"
                "    x, (u._c, y) = 1, (2, 3)\n"
                "    setattr(trainer, '_d', 1)\n"
                "    trainer.public = trainer.state._inner = other._e = 1\n"
            ),
            "loop/component.py": "class C:\n    def f(self):\n        self.trainer._f: int = 1\n",
        },
    )
    assert sorted(private_trainer_writes(package)) == [
        "loop/component.py:3 self.trainer._f",
        "loop/evaluator.py:2 trainer._a",
        "loop/evaluator.py:3 t._b",
        "loop/evaluator.py:4 u._c",
        "loop/evaluator.py:5 setattr(trainer, '_d')",
    ]


# Tests mirror the package: flexengine/<path>/<name>.py is tested in tests/<path>/test_<name>.py (a package's
# __init__.py in test_init.py, __main__.py in test_main.py), so the tests of a module are found without a search.
# A module whose tests all build a run may keep them in the same place under tests/integration/ (the integration
# tier: tests/integration/test_run.py for run.py). The modules below hold no code of their own to test; each says
# why. Anything else without its file fails.
MIRROR_EXEMPT = {
    # package docstrings, nothing else
    "core/__init__.py": "docstring only",
    "data/__init__.py": "docstring only",
    "loop/__init__.py": "docstring only",
    "loop/checkpoint/__init__.py": "docstring only (the checkpoint layout on disk)",
    "planning/__init__.py": "docstring only",
    "surgery/__init__.py": "docstring only",
    # `python -m flexengine.<command>` shims, one import and a call each: tests/integration/cli/test_init.py checks
    # what each imports first, and the command-line tests run them (python -m flexengine.train, .stats, .plan, ...)
    "doctor.py": "python -m shim for cli/doctor.py",
    "plan.py": "python -m shim for cli/plan.py",
    "stats.py": "python -m shim for cli/stats.py",
    "sweep.py": "python -m shim for cli/sweep.py",
    "train.py": "python -m shim for cli/train.py",
}
MIN_MIRRORED = 0.90  # of all modules, the exempt ones counted as unmirrored
INTEGRATION = "integration"  # tests/integration/ mirrors the package as tests/ does


def mirrors_of(module: Path, package: Path, tests: Path) -> tuple[Path, Path]:
    """The test files that mirror `module` (a file under `package`): its unit tests', and its place in the
    integration tree."""
    rel = module.relative_to(package)
    name = {"__init__": "init", "__main__": "main"}.get(rel.stem, rel.stem)
    return tests / rel.parent / f"test_{name}.py", tests / INTEGRATION / rel.parent / f"test_{name}.py"


def unmirrored(package: Path, tests: Path) -> list[str]:
    """Modules under `package` (paths relative to it) with no mirror in `tests`."""
    return [
        path.relative_to(package).as_posix()
        for path in sorted(package.rglob("*.py"))
        if not any(mirror.is_file() for mirror in mirrors_of(path, package, tests))
    ]


def test_every_module_has_its_mirrored_test_file():
    tests = Path(__file__).resolve().parent
    missing = unmirrored(PACKAGE, tests)
    stale = sorted(set(MIRROR_EXEMPT) - set(missing))  # an exempt module that is gone, or has a test file now
    assert not stale, f"MIRROR_EXEMPT names modules that no longer need it (remove them): {stale}"
    unexplained = [m for m in missing if m not in MIRROR_EXEMPT]
    assert not unexplained, (
        "modules without their test file (flexengine/a/b.py -> tests/a/test_b.py, or tests/integration/a/test_b.py "
        "for tests that build a run; move the tests that exercise them there, or write them):\n"
        + "\n".join(unexplained)
    )
    total = len(list(PACKAGE.rglob("*.py")))
    assert (total - len(missing)) / total >= MIN_MIRRORED, f"{total - len(missing)} of {total} modules mirrored"


def test_mirror_check_maps_dunder_files_and_names_what_is_missing(tmp_path):
    package = _write_package(
        tmp_path / "src",
        {
            "__init__.py": "",
            "__main__.py": "",
            "run.py": "",
            "loop/__init__.py": "",
            "loop/trainer.py": "",
            "loop/hooks.py": "",
            "loop/optim.py": "",
        },
    )
    tests = tmp_path / "tests"
    for test_file in ("test_init.py", "test_main.py", "loop/test_trainer.py", "integration/test_run.py"):
        (tests / test_file).parent.mkdir(parents=True, exist_ok=True)
        (tests / test_file).write_text("")
    (tests / "integration" / "test_optim.py").write_text("")  # not loop/optim.py's place in the integration tree
    assert mirrors_of(package / "loop" / "__init__.py", package, tests)[0] == tests / "loop" / "test_init.py"
    assert unmirrored(package, tests) == ["loop/__init__.py", "loop/hooks.py", "loop/optim.py"]


# A .py file under tests/ is a test module (test_*.py), a package marker, conftest.py (fixtures) or helpers.py (what
# tests import); a program the tests start, or a library they share with bench/, lives in tests/support/, so that
# nothing at the top of tests/ looks like a test that is not one.
TEST_TREE_FILES = {"__init__.py", "conftest.py", "helpers.py"}
SUPPORT = "support"


def stray_test_files(tests: Path) -> list[str]:
    """Python files under `tests` that are neither tests, markers, fixtures or helpers, nor under tests/support/."""
    return [
        path.relative_to(tests).as_posix()
        for path in sorted(tests.rglob("*.py"))
        if not (path.name.startswith("test_") or path.name in TEST_TREE_FILES)
        and path.relative_to(tests).parts[0] != SUPPORT
    ]


def test_programs_the_tests_start_live_in_tests_support():
    tests = Path(__file__).resolve().parent
    assert (tests / SUPPORT / "parallel_grads.py").is_file(), "tests/support/ moved: update SUPPORT"
    stray = stray_test_files(tests)
    assert not stray, "move these programs or shared libraries to tests/support/: " + ", ".join(stray)


def test_stray_check_names_a_script_outside_support(tmp_path):
    for rel in ("__init__.py", "conftest.py", "helpers.py", "test_a.py", "support/run_me.py", "run_me.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert stray_test_files(tmp_path) == ["run_me.py"]
