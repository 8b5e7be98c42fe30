"""Optional packages (flexengine/core/extras.py): a missing one stops naming the setting and the pip command; a
broken one keeps its own error; pyproject.toml's extras install exactly the table's packages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flexengine.core import extras
from flexengine.core.errors import UserError
from tests.helpers import hide_package

REPO = Path(__file__).resolve().parents[2]


def test_an_installed_package_is_imported():
    assert extras.require("pyarrow.parquet", "data.source=parquet") is sys.modules["pyarrow.parquet"]
    assert extras.installed("pyarrow")


def test_a_missing_package_names_the_setting_the_extra_and_what_else_to_do(monkeypatch):
    hide_package(monkeypatch, "pyarrow")
    assert not extras.installed("pyarrow")
    with pytest.raises(UserError) as e:
        extras.require("pyarrow.parquet", "data.source=parquet", "convert the files to JSONL (data=jsonl)")
    assert str(e.value) == (
        "data.source=parquet needs the `pyarrow` package, which is not installed: pip install 'flexengine[parquet]', "
        "or convert the files to JSONL (data=jsonl)."
    )


def test_a_package_whose_own_import_fails_keeps_its_error(monkeypatch, tmp_path):
    """Installed but broken (one of its dependencies is missing): "not installed" would send the user the wrong way."""
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import a_dependency_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(extras.EXTRAS, "brokenpkg", "broken")
    with pytest.raises(ModuleNotFoundError) as e:
        extras.require("brokenpkg", "some.key")
    assert e.value.name == "a_dependency_that_is_not_there"


def test_pyproject_extras_install_the_tables_packages_and_tests_get_them_all():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    hard = {req.split(">")[0].split("=")[0].strip() for req in project["dependencies"]}
    for package, extra in extras.EXTRAS.items():
        assert [r.split(">")[0] for r in optional[extra]] == [package], (extra, optional[extra])
        assert package not in hard, f"{package} is both a dependency and the extra {extra}"
    (everything,) = optional["all"]
    assert set(everything.removeprefix("flexengine[").removesuffix("]").split(",")) == set(extras.EXTRAS.values())
    assert "flexengine[all]" in optional["test"]  # scripts/setup.sh and CI install .[test]
