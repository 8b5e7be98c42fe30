"""The shared command-line layer: console scripts, dispatch, schema registration without import side effects,
the short config line, --cfg job and the copy + --config-dir workflow."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from flexengine.cli.common import compose_job, copy_config, format_job_short
from flexengine.core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


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


def test_importing_the_entry_points_registers_nothing_and_loads_no_torch():
    code = (
        "import sys, flexengine.cli.common, flexengine.train, flexengine.plan, flexengine.sweep\n"
        "from hydra.core.config_store import ConfigStore\n"
        "assert 'job_schema.yaml' not in ConfigStore.instance().repo, 'schema registered on import'\n"
        "assert 'torch' not in sys.modules, 'torch imported by a command-line module'\n"
    )
    proc = _run("-c", code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_composing_a_job_loads_neither_torch_nor_transformers():
    """A config mistake fails before the heavy imports (cli/train.py): composing and checking a job, the rules
    that live beside the attention mode table and the precision mode check included, imports neither torch nor
    transformers, and those rules still refuse a bad value naming its key."""
    code = textwrap.dedent(
        """
        import sys
        from flexengine.cli.common import compose_job
        from flexengine.core.errors import UserError

        assert compose_job(["attn=packed_doc", "precision=bf16_sr"]).data.packing == "bfd"  # auto resolved
        bad = {
            "attn.mode": ["attn.mode=nope"],
            "precision.mode": ["precision.mode=nope"],
            "data.packing=none": ["attn=packed_doc", "data.packing=none"],
        }
        for key, overrides in bad.items():
            try:
                compose_job(overrides)
            except UserError as e:
                assert key in str(e), (key, str(e))
            else:
                raise AssertionError(f"{overrides} accepted")
        heavy = sorted({"torch", "transformers"} & set(sys.modules))
        assert not heavy, f"composing a job imported {heavy}"
        """
    )
    proc = _run("-c", code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


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


def test_copy_refuses_unknown_names_and_overwrites(tmp_path):
    with pytest.raises(UserError, match="options of experiment: .*cpu_compare"):
        copy_config("experiment/nope", tmp_path)
    copy_config("model/tiny", tmp_path)
    with pytest.raises(UserError, match="exists"):
        copy_config("model/tiny", tmp_path)


def test_short_config_names_main_fields_and_every_change():
    text = format_job_short(compose_job(["debug=fast", "optim.schedule=linear", "model.lora.r=4"]))
    assert "optim: " in text and "schedule=linear" in text and "lr=0.001" in text
    assert "lora.r=4" in text and "max_steps=4" in text
    assert len(text.splitlines()) <= 10


def test_bad_override_is_one_clear_error(tmp_path):
    proc = _run("-m", "flexengine.train", "optim.schedule=poly", cwd=tmp_path)
    assert proc.returncode == 2
    assert "flexengine: error: optim.schedule='poly' is not valid" in proc.stderr
    assert "Traceback" not in proc.stderr
