"""The `flexengine <command>` console command (flexengine/__main__.py): every tool behind one name, dispatched
without importing the others, `copy` for a shipped config to edit, and usage on a wrong or missing command."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from flexengine.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_every_console_script_points_at_a_callable():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {
        "flexengine",
        "flexengine-train",
        "flexengine-plan",
        "flexengine-doctor",
        "flexengine-stats",
        "flexengine-sweep",
    } <= set(scripts)
    for target in scripts.values():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), target


def test_flexengine_command_dispatches_to_the_planner(tmp_path):
    proc = _run("-m", "flexengine", "plan", "model=deepseek7b", "hardware=a100_80g", "plan.format=json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["hf_config"]["model_type"] == "llama"
    bad = _run("-m", "flexengine", "nonsense", cwd=tmp_path)
    assert bad.returncode == 2 and "flexengine train" in bad.stderr


def test_copied_experiment_runs_from_config_dir(tmp_path):
    proc = _run("-m", "flexengine", "copy", "experiment/cpu_compare", str(tmp_path / "my_conf"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--config-dir" in proc.stdout
    copied = tmp_path / "my_conf" / "experiment" / "cpu_compare.yaml"
    mine = copied.with_name("mine.yaml")
    mine.write_text(copied.read_text().replace("max_steps: 20", "max_steps: 7"))  # the user's edit
    proc = _run(
        "-m",
        "flexengine.train",
        "--config-dir",
        str(tmp_path / "my_conf"),
        "experiment=mine",
        "--cfg",
        "job",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "max_steps: 7" in proc.stdout and "seq_len: 512" in proc.stdout
    assert not list(tmp_path.glob("outputs"))  # --cfg job runs nothing


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), (["-h"], 0), ([], 2), (["trian"], 2)])
def test_help_exits_0_and_a_wrong_or_missing_command_exits_2_with_the_usage(argv, code, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == code
    usage = capsys.readouterr().err
    assert all(f"flexengine {c}" in usage for c in COMMANDS)  # the table names every command


def test_copy_in_process_prints_how_to_run_the_copy(tmp_path, capsys):
    main(["copy", "model/tiny", str(tmp_path / "conf")])
    out = capsys.readouterr().out
    assert (tmp_path / "conf" / "model" / "tiny.yaml").is_file()
    assert f"flexengine-train --config-dir {tmp_path / 'conf'} model=tiny" in out


@pytest.mark.parametrize("argv", [["copy"], ["copy", "model/tiny"], ["copy", "model/nope", "d"]])
def test_copy_misuse_is_one_error_with_exit_2(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("\nflexengine: error: ") and ("usage: flexengine copy" in err or "model/nope" in err)


def test_each_command_is_dispatched_to_its_own_entry_point(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main rewrites sys.argv: restored after the test
    called = []
    for command, module, attr in [
        ("train", "flexengine.cli.train", "main"),
        ("plan", "flexengine.cli.plan", "cli"),
        ("doctor", "flexengine.cli.doctor", "main"),
        ("stats", "flexengine.cli.stats", "main"),
        ("sweep", "flexengine.cli.sweep", "main"),
    ]:
        monkeypatch.setattr(importlib.import_module(module), attr, lambda c=command: called.append((c, list(sys.argv))))
        main([command, "a=1", "b=2"])
    assert [c for c, _ in called] == ["train", "plan", "doctor", "stats", "sweep"]
    for command, argv in called:  # Hydra and argparse read sys.argv: the tool sees its own name and the rest
        assert argv == [f"flexengine-{command}", "a=1", "b=2"]
