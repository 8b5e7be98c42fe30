"""model.path=<pretrained checkpoint> without a model group: fine-tuning defaults, each logged with its source."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from flexengine.cli.common import compose_job
from flexengine.core.config import conf_dir
from flexengine.core.errors import UserError
from flexengine.data.demo import load_demo_tokenizer
from tests.helpers import TINY_LLAMA

# the 7B fine-tuning defaults every shipped 7B model config carries (read, not restated)
SHIPPED = yaml.safe_load((conf_dir() / "model" / "llama2_7b.yaml").read_text())


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A small pretrained-looking HF directory: save_pretrained weights, config and tokenizer."""
    path = tmp_path / "my-small-llama"
    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "vocab_size": 2048})).save_pretrained(path)
    load_demo_tokenizer().save_pretrained(path)
    return path


def test_pretrained_path_alone_gets_fine_tuning_defaults_with_their_source(checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        job = compose_job([f"model.path={checkpoint}"])
    assert job.optim.lr == SHIPPED["optim"]["lr"] == 2e-5  # was the demo's 1e-3
    assert job.optim.weight_decay == SHIPPED["optim"]["weight_decay"] == 0.0  # was 0.1
    assert job.optim.warmup_steps == SHIPPED["optim"]["warmup_steps"]
    assert job.model.name == "my-small-llama"  # never "tiny"
    # a few-hundred-thousand-parameter model is not 7B: the demo's batch shape stays, and the log says why
    assert (job.train.micro_batch, job.train.grad_accum) == (2, 2)
    log = caplog.text
    assert "holds pretrained weights" in log and "optim.lr=2e-05 (from conf/model/" in log
    assert "train.micro_batch=2 (kept: " in log and "model.name=my-small-llama (the directory name" in log
    # the demo's step count is kept (it follows the data, not the model) but listed, so it is not a silent default
    assert f"train.max_steps={job.train.max_steps} (kept: the demo's; set it for your data)" in log


def test_the_users_own_settings_are_kept(checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        job = compose_job([f"model.path={checkpoint}", "optim.lr=1e-3", "debug=fast"])
    assert job.optim.lr == 1e-3  # given on the command line, even though it is the demo's value
    assert job.optim.warmup_steps == 1  # debug=fast's, not the fine-tuning default
    assert job.optim.weight_decay == 0.0
    assert "optim.lr=0.001 (yours)" in caplog.text
    assert f"train.max_steps={job.train.max_steps} (yours)" in caplog.text  # debug=fast's


def test_a_named_model_group_random_init_or_weightless_dir_changes_nothing(checkpoint, tmp_path):
    assert compose_job([f"model.path={checkpoint}", "model.init=random"]).optim.lr == 1e-3
    assert compose_job([]).optim.lr == 1e-3  # the demo itself
    bare = tmp_path / "config-only"
    LlamaConfig(**TINY_LLAMA).save_pretrained(bare)  # no weights: nothing pretrained to protect
    assert compose_job([f"model.path={bare}", "model.init=random"]).model.name == "tiny"


def test_a_7b_checkpoint_gets_the_7b_batch_shape(tmp_path):
    """The parameter count (from config.json) picks the shipped config of that size: its micro-batch,
    accumulation come too. (The weight file only has to be a valid one: nothing is loaded here.)"""
    arch = {k: v for k, v in SHIPPED["model"]["arch"].items() if k != "model_type"}
    path = tmp_path / "Llama-2-7b-hf"
    LlamaConfig(**arch).save_pretrained(path)
    save_file({}, path / "model.safetensors")  # a well-formed file of no tensors (an empty one is damaged)
    job = compose_job([f"model.path={path}"])
    assert (job.train.micro_batch, job.train.grad_accum) == (SHIPPED["train"]["micro_batch"], 8)
    assert job.optim.lr == 2e-5
    assert job.model.name == "Llama-2-7b-hf"


@pytest.mark.parametrize("group", [["model=deepseek7b"], ["experiment=deepseek7b_6k_a100", "data.source=demo"]])
def test_a_typed_warmup_ratio_wins_over_a_config_files_warmup_steps(group, caplog):
    """Before: every shipped 7B model/experiment config sets optim.warmup_steps, so optim.warmup_ratio alone was
    refused on exactly the models where it is wanted (review 22 #9). Typed together, the two stay an error."""
    file_steps = compose_job([*group, "model.init=random"]).optim.warmup_steps
    assert file_steps is not None
    with caplog.at_level(logging.INFO, logger="flexengine.cli.first_contact"):
        job = compose_job([*group, "model.init=random", "optim.warmup_ratio=0.05"])
    assert job.optim.warmup_steps is None and job.optim.warmup_for(400) == 20
    assert f"optim.warmup_ratio=0.05 (command line) wins over optim.warmup_steps={file_steps}" in caplog.text
    typed_steps = compose_job([*group, "model.init=random", "optim.warmup_steps=7"])
    assert typed_steps.optim.warmup_for(400) == 7
    with pytest.raises(UserError, match="are both set"):
        compose_job([*group, "model.init=random", "optim.warmup_ratio=0.05", "optim.warmup_steps=7"])
