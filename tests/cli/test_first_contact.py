"""model.path=<pretrained checkpoint> without a model group: fine-tuning defaults, each logged with its source."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from flexengine.cli.common import compose_job, compose_job_record
from flexengine.cli.first_contact import GENERIC_FINETUNE, LORA_LR, accumulation_keeping_rows
from flexengine.core.config import conf_dir
from flexengine.core.errors import UserError
from flexengine.data.demo import load_demo_tokenizer
from tests.helpers import TINY_LLAMA

# the 7B fine-tuning defaults every shipped 7B model config carries (read, not restated)
SHIPPED = yaml.safe_load((conf_dir() / "model" / "llama2_7b.yaml").read_text())
FAST_OPTIM = yaml.safe_load((conf_dir() / "debug" / "fast.yaml").read_text())["optim"]
WARMUP_KEYS = ("warmup_steps", "warmup_ratio")
MODELS_AND_EXPERIMENTS = [
    f"{group}={path.stem}" for group in ("model", "experiment") for path in sorted((conf_dir() / group).glob("*.yaml"))
]


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
    # a few-hundred-thousand-parameter model is the size of no shipped config: the generic fine-tuning defaults
    assert job.optim.lr == GENERIC_FINETUNE["optim.lr"] == 2e-5  # was the demo's 1e-3
    assert job.optim.weight_decay == GENERIC_FINETUNE["optim.weight_decay"] == 0.0  # was 0.1
    assert job.optim.warmup_ratio == GENERIC_FINETUNE["optim.warmup_ratio"] and job.optim.warmup_steps is None
    assert job.model.name == "my-small-llama"  # never "tiny"
    # and the demo's batch shape stays, and the log says why
    assert (job.train.micro_batch, job.train.grad_accum) == (2, 2)
    log = caplog.text
    assert "holds pretrained weights" in log and "optim.lr=2e-05 (from flexengine's generic" in log
    assert "no shipped model config is within 1.3x" in log and "model.name=my-small-llama (the directory name" in log
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


def _checkpoint_of(tmp_path: Path, name: str, **arch) -> Path:
    """A model directory of llama2_7b.yaml's architecture with `arch` changed (the weight file only has to be a valid
    one: nothing is loaded here)."""
    config = {k: v for k, v in SHIPPED["model"]["arch"].items() if k != "model_type"} | arch
    path = tmp_path / name
    LlamaConfig(**config).save_pretrained(path)
    save_file({}, path / "model.safetensors")  # a well-formed file of no tensors (an empty one is damaged)
    return path


def test_a_7b_checkpoint_gets_the_7b_config(tmp_path, caplog):
    """The parameter count (from config.json) picks the shipped config of that size: its fine-tuning values, its
    micro-batch and accumulation come too, each noted with its file."""
    path = _checkpoint_of(tmp_path, "Llama-2-7b-hf")
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        job = compose_job([f"model.path={path}"])
    assert (job.train.micro_batch, job.train.grad_accum) == (SHIPPED["train"]["micro_batch"], 8)
    assert job.optim.lr == 2e-5 and job.optim.warmup_ratio == SHIPPED["optim"]["warmup_ratio"]
    assert job.model.name == "Llama-2-7b-hf"
    assert "train.grad_accum=8 (from conf/model/" in caplog.text


def test_a_13b_checkpoint_is_not_7b_sized(tmp_path, caplog):
    """Llama-2-13B (13.0B parameters, 1.9x the 7B configs) used to count as 7B-sized (anything from 3.4B to 14.5B)
    and took their batch shape; now it gets the generic defaults and the log says no shipped config is its size."""
    path = _checkpoint_of(
        tmp_path,
        "Llama-2-13b-hf",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
    )
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        job = compose_job([f"model.path={path}"])
    assert (job.train.micro_batch, job.train.grad_accum) == (2, 2)  # the demo's, not the 7B's 1 x 8
    assert job.optim.lr == 2e-5 and job.optim.weight_decay == 0.0
    assert "13.02B parameters: no shipped model config is within 1.3x" in caplog.text
    assert "optim.lr=2e-05 (from flexengine's generic fine-tuning defaults" in caplog.text
    # an 8B (Llama-3-8B's width) is 7B-sized
    eight = _checkpoint_of(tmp_path, "llama-8b", intermediate_size=14336, vocab_size=128256, num_key_value_heads=8)
    assert compose_job([f"model.path={eight}"]).train.grad_accum == 8


def test_micro_batch_typed_alone_keeps_the_configs_rows_per_step(tmp_path, caplog):
    """train.micro_batch=4 on a 7B-sized checkpoint used to bring in the 7B's grad_accum=8 (32 rows per step, not
    the config's 8): the accumulation follows, and the log says how to choose both."""
    path = _checkpoint_of(tmp_path, "Llama-2-7b-hf")
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        job = compose_job([f"model.path={path}", "train.micro_batch=4"])
    assert (job.train.micro_batch, job.train.grad_accum) == (4, 2)
    assert "train.grad_accum=2 (keeps conf/model/llama2_7b.yaml's 8 rows per optimizer step" in caplog.text
    job = compose_job([f"model.path={path}", "train.micro_batch=4", "train.grad_accum=8"])  # both typed: as typed
    assert (job.train.micro_batch, job.train.grad_accum) == (4, 8)


@pytest.mark.parametrize("group", [["model=llama2_7b"], ["experiment=llama2_7b_4k_a100", "data.source=demo"]])
def test_micro_batch_typed_alone_over_a_config_file_keeps_its_rows_per_step(group, caplog):
    """The same rule for a named model or experiment config (1 x 8 and 2 x 4: 8 rows per step): micro_batch=4 typed
    alone keeps 8 rows per step, and 3 (which does not divide 8) takes the nearest, saying so."""
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        job = compose_job([*group, "model.init=random", "train.micro_batch=4"])
    assert (job.train.micro_batch, job.train.grad_accum) == (4, 2)
    assert "-> 2 keeps the 8 rows per optimizer step of conf/" in caplog.text
    assert compose_job([*group, "model.init=random", "train.micro_batch=3"]).train.grad_accum == 3
    assert "as near as 3 divides them: 9" in caplog.text
    assert compose_job([*group, "model.init=random", "train.micro_batch=4", "train.grad_accum=8"]).train.grad_accum == 8


@pytest.mark.parametrize("group", [["model=deepseek7b"], ["experiment=deepseek7b_6k_a100", "data.source=demo"]])
def test_a_typed_warmup_steps_wins_over_a_config_files_warmup_ratio(group, caplog):
    """The shipped 7B model/experiment configs warm up for a fraction of the run (optim.warmup_ratio: 50 steps
    never ended a short run); a typed optim.warmup_steps replaces it, and the other way round. Typed together, the
    two stay an error."""
    file_job = compose_job([*group, "model.init=random"])
    assert file_job.optim.warmup_steps is None and file_job.optim.warmup_ratio is not None
    assert file_job.optim.warmup_for(20) == round(20 * file_job.optim.warmup_ratio)  # a short run warms up briefly
    with caplog.at_level(logging.INFO, logger="flexengine.cli.first_contact"):
        job = compose_job([*group, "model.init=random", "optim.warmup_steps=7"])
    assert job.optim.warmup_ratio is None and job.optim.warmup_for(400) == 7
    assert f"optim.warmup_steps=7 (command line) wins over optim.warmup_ratio={file_job.optim.warmup_ratio}" in (
        caplog.text
    )
    assert compose_job([*group, "model.init=random", "optim.warmup_ratio=0.05"]).optim.warmup_for(400) == 20
    with pytest.raises(UserError, match="are both set"):
        compose_job([*group, "model.init=random", "optim.warmup_ratio=0.05", "optim.warmup_steps=7"])


@pytest.mark.parametrize("choice", MODELS_AND_EXPERIMENTS)
def test_every_shipped_model_and_experiment_composes_with_debug_fast(choice):
    """debug=fast warms up for a step count, the 7B configs for a ratio of the run: of the two, the file composed
    later wins (a model group composes before debug, an experiment after it) and the other is nulled, its source
    saying which file excluded it; both set used to refuse debug=fast with every 7B model and experiment."""
    job, record = compose_job_record([choice, "debug=fast", "model.init=random", "data.source=demo"])
    group, option = choice.split("=")
    own = (yaml.safe_load((conf_dir() / group / f"{option}.yaml").read_text()) or {}).get("optim", {})
    last = own if group == "experiment" and any(key in own for key in WARMUP_KEYS) else FAST_OPTIM
    assert (job.optim.warmup_steps, job.optim.warmup_ratio) == (last.get("warmup_steps"), last.get("warmup_ratio"))
    if group == "model" and own.get("warmup_ratio") is not None:
        assert record.sources["optim.warmup_ratio"] == (
            "config: conf/debug/fast.yaml (optim.warmup_steps set there excludes it)"
        )


@pytest.mark.parametrize(
    ("config", "micro", "expected"),
    [((1, 8), 4, (2, 8)), ((1, 8), 3, (3, 8)), ((2, 4), 16, (1, 8)), ((2, 1), 2, (1, 2))],
)
def test_one_rule_keeps_a_configs_rows_per_step(config, micro, expected):
    """Both routes (first-contact's shipped config, a model/experiment file) use it: rows = micro_batch x
    grad_accum, the accumulation at the typed micro-batch the nearest, never below 1."""
    assert accumulation_keeping_rows(*config, micro) == expected


def test_a_lora_run_gets_a_lora_learning_rate(checkpoint, tmp_path, caplog):
    """LoRA trains adapters that start at zero: the full fine-tune's 2e-5 (generic, or a 7B config's) barely moves
    them. model.lora.r > 0 takes LORA_LR instead, logged and recorded with its source; a typed lr stays."""
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        job, record = compose_job_record([f"model.path={checkpoint}", "model.lora.r=8"])
    assert job.optim.lr == LORA_LR == 1e-4 and job.optim.weight_decay == GENERIC_FINETUNE["optim.weight_decay"]
    assert "optim.lr=0.0001 (from the usual LoRA rate, first_contact.LORA_LR" in caplog.text
    assert record.sources["optim.lr"].startswith("first-contact: from the usual LoRA rate")
    seven = _checkpoint_of(tmp_path, "Llama-2-7b-hf")
    assert compose_job([f"model.path={seven}", "model.lora.r=16"]).optim.lr == LORA_LR  # not llama2_7b.yaml's 2e-5
    assert compose_job([f"model.path={seven}"]).optim.lr == SHIPPED["optim"]["lr"]  # a full fine-tune keeps it
    assert compose_job([f"model.path={checkpoint}", "model.lora.r=8", "optim.lr=3e-4"]).optim.lr == 3e-4


def test_the_header_shows_the_demos_values_and_labels_the_users_as_theirs(checkpoint, caplog):
    """Before: "the demo's from-scratch settings (model=tiny: lr 0.0005, ...) are replaced" named the user's own
    lr as the demo's, and typed train.micro_batch=1 train.grad_accum=1 were "the demo's ... stays"."""
    typed = ["optim.lr=5e-4", "train.micro_batch=1", "train.grad_accum=1"]
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        job = compose_job([f"model.path={checkpoint}", *typed])
    assert (job.optim.lr, job.train.micro_batch, job.train.grad_accum) == (5e-4, 1, 1)
    log = caplog.text
    assert "the demo's from-scratch settings (model=tiny: lr 0.001, weight decay 0.1)" in log
    assert "optim.lr=0.0005 (yours)" in log and "yours are kept" in log
    assert "train.micro_batch=1 (yours) x train.grad_accum=1 (yours) stay" in log and "the demo's train." not in log
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.first_contact"):
        compose_job([f"model.path={checkpoint}", "train.micro_batch=1"])
    assert "train.micro_batch=1 (yours) x train.grad_accum=2 (the demo's) stay" in caplog.text


@pytest.mark.parametrize(
    "arch",
    [
        {},  # LLaMA, grouped KV heads
        {"tie_word_embeddings": True},
        {"attention_bias": True, "head_dim": 32},
        {"num_key_value_heads": 4},  # plain multi-head
    ],
)
def test_parameters_counted_from_config_json_equal_the_built_model(tmp_path, arch):
    """The first line's count comes from config.json arithmetic (no torch import): it equals the parameters of the
    model transformers builds from that file, and ModelShape's count."""
    from flexengine.cli.first_contact import config_json_params
    from flexengine.planning.shapes import ModelShape

    config = LlamaConfig(**{**TINY_LLAMA, **arch})
    config.save_pretrained(tmp_path)
    written = yaml.safe_load((tmp_path / "config.json").read_text())
    built = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert config_json_params(written) == built == ModelShape.from_hf_config(config).params
    assert config_json_params({k: v for k, v in written.items() if k != "hidden_size"}) is None  # not counted


def test_first_contact_imports_neither_torch_nor_transformers(checkpoint):
    """Before: the HF config was built (torch and transformers imported, 9-26 s on a loaded machine) to count the
    parameters before the run's first line."""
    import subprocess
    import sys

    code = (
        "import sys; from flexengine.cli.common import compose_job; "
        f"job = compose_job(['model.path={checkpoint}']); "
        "print(job.optim.lr, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["2e-05", "False", "False"], out.stderr[-2000:]
