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
