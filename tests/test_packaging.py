"""The configs live in the top-level conf/ and still ship inside the installed package (as flexengine/conf/).

Builds the wheel from this checkout, unpacks it into an empty directory and, in a fresh interpreter that cannot
see the checkout, composes configs from it through every route the project uses: conf_dir() + the compose API,
the package resource `flexengine.conf` (Hydra's pkg://), and `python -m flexengine.train` (hydra.main).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHECK = """
import dataclasses, importlib.resources, json, sys
from pathlib import Path
import flexengine
from flexengine.core.config import conf_dir
site = Path(sys.argv[1]).resolve()
assert Path(flexengine.__file__).resolve().is_relative_to(site), flexengine.__file__
assert conf_dir() == site / "flexengine" / "conf", conf_dir()
assert importlib.resources.files("flexengine.conf").joinpath("config.yaml").is_file()
from hydra import compose, initialize_config_dir, initialize_config_module
from flexengine.cli.common import register_schema, to_job_config
register_schema()
jobs = {}
with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
    for name, overrides in json.loads(sys.argv[2]).items():
        jobs[name] = dataclasses.asdict(to_job_config(compose("config", overrides=overrides)))
with initialize_config_module(version_base="1.3", config_module="flexengine.conf"):  # Hydra's pkg:// route
    jobs["pkg"] = dataclasses.asdict(to_job_config(compose("config")))
print(json.dumps(jobs))
"""
PLACEHOLDERS = ["model.path=/models/any", "data.path=/data/any.jsonl"]  # the 7B experiments name local files


def _compose_here(cases: dict[str, list[str]]) -> dict[str, dict]:
    """The same configs composed from this checkout's conf/, in this process: what the wheel must reproduce."""
    from hydra import compose, initialize_config_dir

    from flexengine.cli.common import register_schema, to_job_config
    from flexengine.core.config import conf_dir

    register_schema()
    assert conf_dir() == REPO / "conf"
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        return {
            name: json.loads(json.dumps(dataclasses.asdict(to_job_config(compose("config", overrides=o)))))
            for name, o in cases.items()
        }


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONNOUSERSITE": "1", **env}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_checkout_conf_is_the_package_flexengine_conf():
    import importlib.resources

    import flexengine.conf
    from flexengine.core.config import conf_dir

    assert Path(flexengine.conf.__file__).resolve() == REPO / "conf" / "__init__.py"
    assert conf_dir() == REPO / "conf" and not (REPO / "flexengine" / "conf" / "config.yaml").exists()
    assert importlib.resources.files("flexengine.conf").joinpath("config.yaml").is_file()  # Hydra's pkg:// route


def test_no_config_left_under_the_old_location():
    # A branch that added a config group under flexengine/conf/ before the move keeps it there after a rebase (git
    # moves new files only into directories that existed): such a file would silently never be composed.
    stray = sorted(str(p.relative_to(REPO)) for p in (REPO / "flexengine" / "conf").rglob("*.yaml"))
    assert not stray, "configs live in the top-level conf/ now; move them with " + "; ".join(
        f"git mv {s} {s.removeprefix('flexengine/')}" for s in stray
    )


@pytest.mark.slow
def test_wheel_ships_conf_and_composes_from_it(tmp_path):
    src, dist, site, elsewhere = tmp_path / "src", tmp_path / "dist", tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
    # build from a copy of what the wheel is made of, so the checkout gets no build/ or egg-info directories
    for name in ("flexengine", "conf"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    build = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(dist), str(src)],
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    # setuptools warns (~300 lines, shown by scripts/setup.sh's pip) about each importable directory that
    # [tool.setuptools] packages does not list: every conf/ group must be listed there
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr, "list it in pyproject.toml"
    (wheel,) = dist.glob("flexengine-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(site)
    shipped = {n.removeprefix("flexengine/conf/") for n in names if n.startswith("flexengine/conf/")}
    in_repo = {str(p.relative_to(REPO / "conf")) for p in (REPO / "conf").rglob("*") if p.suffix in (".yaml", ".py")}
    assert shipped == in_repo  # every config, nothing else under it
    # every module of the checkout is in the wheel (pyproject lists the packages: a new one must be added there)
    modules = {str(p.relative_to(REPO)) for p in (REPO / "flexengine").rglob("*.py")}
    assert modules - names == set(), "add their packages to [tool.setuptools] packages in pyproject.toml"

    cases = {"default": []}
    cases.update(
        {
            f"experiment={p.stem}": [f"experiment={p.stem}", *PLACEHOLDERS]
            for p in sorted((REPO / "conf" / "experiment").glob("*.yaml"))
        }
    )
    check = _run([sys.executable, "-c", CHECK, str(site), json.dumps(cases)], cwd=elsewhere, PYTHONPATH=str(site))
    assert check.returncode == 0, check.stderr[-3000:]
    from_wheel = json.loads(check.stdout.strip().splitlines()[-1])
    expected = _compose_here(cases)
    assert from_wheel.pop("pkg") == expected["default"]
    assert from_wheel == expected
    # hydra.main from the wheel: print the composed job config without running it
    cli = _run(
        [sys.executable, "-m", "flexengine.train", "experiment=cpu_compare", "--cfg", "job"],
        cwd=elsewhere,
        PYTHONPATH=str(site),
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "seq_len: 512" in cli.stdout
