"""Config mistakes at composition leave like every UserError (one paragraph, exit 2): keys the schema lacks, added
with + / ++ or written in a config file, name the nearest real key; Hydra's own errors (unknown group option, an
override it cannot parse, a wrong type) are retold the same way."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flexengine.cli.common import compose_config, compose_job, to_job_config
from flexengine.core.errors import UserError

ROOT = Path(__file__).resolve().parents[3]


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flexengine.train", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def _one_paragraph_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr
    message = proc.stderr.strip()
    assert message.startswith("flexengine: error: ") and "\n" not in message, message
    return message


def test_added_key_stops_the_real_run_naming_the_nearest_key(tmp_path):
    message = _one_paragraph_error(_train("+train.batch_size=4", cwd=tmp_path))
    assert "train.batch_size (from the command line: did you mean train.micro_batch?)" in message
    assert not list(tmp_path.glob("outputs/**/checkpoints"))  # nothing trained


@pytest.mark.parametrize(
    "sweep", [["+train.batch_size=4", "optim.lr=1e-3,2e-3"], ["+train.batch_size=4,8"], ["train.batch_size=4,8"]]
)
def test_a_sweep_with_an_unknown_key_stops_once_before_any_job(tmp_path, sweep):
    """Each job used to fail alone (a failed row each) and the sweep exited 0; now the sweep's first combination is
    composed and checked before Hydra launches anything."""
    message = _one_paragraph_error(_train("-m", *sweep, f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path))
    assert "train.batch_size (from the command line: did you mean train.micro_batch?)" in message
    assert not (tmp_path / "sweep").exists()  # no job launched


@pytest.mark.parametrize("flag", [["--cfg", "job"], ["-c", "job"], ["--cfg=all"]])
def test_printing_the_config_refuses_an_unknown_key_instead_of_showing_it_as_valid(tmp_path, flag):
    proc = _train("+train.batch_size=4", *flag, cwd=tmp_path)
    assert "did you mean train.micro_batch?" in _one_paragraph_error(proc)
    assert "batch_size" not in proc.stdout


def test_the_unknown_key_message_points_to_a_command_that_checks_keys(tmp_path):
    """`--cfg job` printed the typo as a valid key; the message names plan.format=resolved, which checks them."""
    message = _one_paragraph_error(_train("+train.batch_size=4", cwd=tmp_path))
    assert "--cfg" not in message and "flexengine-plan <the same overrides" in message
    assert "plan.format=resolved" in message


def test_a_model_arch_key_the_hf_config_lacks_stops_the_run(tmp_path):
    """model.arch is open-ended for the schema (any HF field), but a key the family's config class lacks is a typo:
    it used to train the unchanged model."""
    message = _one_paragraph_error(_train("debug=fast", "+model.arch.num_hiden_layers=2", cwd=tmp_path))
    assert "model.arch.num_hiden_layers (did you mean model.arch.num_hidden_layers?)" in message


def test_top_level_typo_points_at_the_nested_key(tmp_path):
    message = _one_paragraph_error(_train("++lr=2e-5", cwd=tmp_path))
    assert "lr (from the command line: did you mean optim.lr?)" in message


@pytest.mark.parametrize("prefix", ["", "+"])
def test_a_misspelled_group_names_the_key_typed_and_the_nearest_group(tmp_path, prefix):
    """Before: `trian.max_steps=3` was blamed on "a config file" with the hint data.train_on."""
    message = _one_paragraph_error(_train(f"{prefix}trian.max_steps=3", cwd=tmp_path))
    assert "trian.max_steps (from the command line: did you mean train.max_steps?)" in message
    assert "config file:" not in message and "data.train_on" not in message


def test_set_key_is_told_the_same_and_not_advised_to_add_it(tmp_path):
    message = _one_paragraph_error(_train("train.batch_size=4", cwd=tmp_path))
    assert "did you mean train.micro_batch?" in message and "+train.batch_size" not in message


def test_key_from_a_config_file_names_the_file(tmp_path):
    experiment = tmp_path / "mine" / "experiment" / "typo.yaml"
    experiment.parent.mkdir(parents=True)
    experiment.write_text("# @package _global_\ntrain:\n  batch_size: 4\n")
    message = _one_paragraph_error(_train("--config-dir", str(tmp_path / "mine"), "experiment=typo", cwd=tmp_path))
    assert "train.batch_size (from config experiment/typo: did you mean train.micro_batch?)" in message


def test_every_unknown_added_key_is_listed_in_process():
    cfg = compose_config(["+train.batch_size=4", "+optim.learning_rate=1e-4", "+foo.bar=1"])
    with pytest.raises(UserError) as e:
        to_job_config(cfg, ["+train.batch_size=4", "+optim.learning_rate=1e-4", "+foo.bar=1"])
    text = str(e.value)
    assert "train.batch_size (from the command line: did you mean train.micro_batch?)" in text
    assert "optim.learning_rate (from the command line: did you mean optim.lr?)" in text
    assert "foo.bar (from the command line: no key of the config is close)" in text  # the key typed


def test_open_ended_keys_are_accepted():
    job = compose_job(["++model.arch.rope_theta=500000.0", "+model.arch.attention_bias=true"])
    assert job.model.arch["rope_theta"] == 500000.0 and job.model.arch["attention_bias"] is True


@pytest.mark.parametrize(
    "override, expected",
    [
        ("attn=nope", "attn=nope is not a config of group attn; choose one of causal, packed_doc"),
        ("train.max_steps=[1", "cannot read the override 'train.max_steps=[1'"),
        ("train.max_steps", "cannot read the override 'train.max_steps': missing EQUAL"),
        ("train.max_steps=abc", "cannot apply the override train.max_steps=abc: Value 'abc'"),
        ("hydra.nope=1", "hydra.nope is not one of Hydra's settings"),
    ],
)
def test_hydra_composition_errors_are_one_paragraph_with_exit_2(tmp_path, override, expected):
    assert expected in _one_paragraph_error(_train(override, cwd=tmp_path))


def test_plan_tool_refuses_the_same_way(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flexengine.plan", "+plan.formt=json"], cwd=tmp_path, capture_output=True, text=True
    )
    assert "plan.formt (from the command line: did you mean plan.format?)" in _one_paragraph_error(proc)


def test_hydra_full_error_set_by_the_user_keeps_hydras_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flexengine.train", "attn=nope"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert proc.returncode == 1 and "MissingConfigException" in proc.stderr


def test_a_config_error_loads_neither_torch_nor_transformers_and_is_quick():
    """Refusing a key happens before the heavy imports; torch's import alone costs more CPU than the bound."""
    code = textwrap.dedent(
        """
        import sys, time
        sys.argv = ["flexengine-train", "+train.batch_size=4"]
        from flexengine.cli.train import main
        try:
            main()
        except SystemExit as e:
            assert e.code == 2, e.code
        heavy = sorted({"torch", "transformers"} & set(sys.modules))
        assert not heavy, f"a config error imported {heavy}"
        print(time.process_time())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout) < 1.5, proc.stdout  # CPU seconds, interpreter start included (~0.65 measured)
