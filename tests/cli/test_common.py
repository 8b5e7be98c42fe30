"""The shared command-line layer (flexengine/cli/common.py): composing a job without import side effects or heavy
imports, the short config line, copying a shipped config, and a bad override as one clear error. The `flexengine`
command that dispatches to each tool is tested in tests/test_main.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flexengine.cli.common import compose_job, copy_config, format_job_short, group_options, write_job_error
from flexengine.core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


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
            "memory.granularity": ["memory=selective", "memory.granularity=nope"],
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


def test_group_options_are_the_shipped_yaml_names():
    shipped = sorted(p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml"))
    assert group_options("precision") == tuple(shipped) and "auto" in shipped
    assert group_options("no_such_group") == ()


def test_copy_is_byte_identical_to_the_shipped_file(tmp_path):
    target = copy_config("model/tiny.yaml", tmp_path)  # the .yaml suffix is optional
    assert target == tmp_path / "model" / "tiny.yaml"
    assert target.read_bytes() == (ROOT / "conf" / "model" / "tiny.yaml").read_bytes()
    with pytest.raises(UserError, match="give <group>/<option> \\(groups: .*experiment"):
        copy_config("nonsense", tmp_path)


def test_short_config_shortens_floats_and_long_lists():
    job = compose_job(["optim.lr=0.00025", "data.source=jsonl", f"data.path={'/d/' + 'x' * 60}.jsonl"])
    text = format_job_short(job)
    assert "lr=0.00025 " in text  # %g, not 0.00025000000000000006
    path = f"/d/{'x' * 60}.jsonl"
    assert f"path={path}" in text  # a string is shown whole; only lists and dicts are cut at 40 characters
    job = compose_job(["train.sample_prompts=[" + ",".join(["abcdefghij"] * 6) + "]"])
    shown = next(w for w in format_job_short(job).split() if w.startswith("sample_prompts="))
    # the JSON is 1 + 6 x 12 + 5 + 1 = 79 characters: its first 37 ("[" + two items of 12 + two commas + '"abcdefghi')
    assert shown == "sample_prompts=" + '["abcdefghij","abcdefghij","abcdefghi...'


def test_a_failed_job_is_recorded_with_its_type_message_and_traceback(tmp_path):
    try:
        raise UserError("  data.path=/nope does not exist  ")
    except UserError as e:
        path = write_job_error(tmp_path / "job", e)
    record = json.loads(path.read_text())
    assert path == tmp_path / "job" / "error.json"
    assert record["type"] == "UserError" and record["message"] == "data.path=/nope does not exist"
    assert record["traceback"].startswith("Traceback") and "test_a_failed_job_is_recorded" in record["traceback"]


def test_quiet_third_party_leaves_everything_on_when_asked(monkeypatch):
    import logging
    import os

    from flexengine.cli.common import QUIET_ENV, quiet_third_party

    for name in QUIET_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLEXENGINE_VERBOSE", "1")
    level = logging.getLogger("torch.utils._pytree").level
    quiet_third_party()
    assert not any(name in os.environ for name in QUIET_ENV)
    assert logging.getLogger("torch.utils._pytree").level == level


def test_the_output_root_resolver_reads_null_and_empty_as_unset():
    from omegaconf import OmegaConf

    from flexengine.cli.common import register_schema

    register_schema()
    for value, want in ((None, "outputs"), ("", "outputs"), ("/runs/a", "/runs/a")):
        cfg = OmegaConf.create({"train": {"output_dir": value}, "d": "${flexengine_output_root:${train.output_dir}}"})
        assert cfg.d == want
