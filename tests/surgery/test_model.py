"""model.path alone trains that directory's architecture and weights; random weights only when asked, loudly."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from flexengine.core.config import ModelConfig, conf_dir
from flexengine.core.errors import UserError
from flexengine.surgery.model import build_hf_config, build_meta_model, load_model
from tests.helpers import make_llama

CPU = torch.device("cpu")


@pytest.fixture
def rigged_dir(tmp_path):
    """A 3-layer LLaMA (the tiny default has 4) whose lm_head is scaled 50x: its loss is unmistakable."""
    model = make_llama(num_hidden_layers=3, hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    model.save_pretrained(tmp_path / "rigged")
    return tmp_path / "rigged"


def test_model_path_alone_loads_its_architecture_and_weights(rigged_dir, caplog):
    model = ModelConfig(path=str(rigged_dir), arch={"model_type": "llama", "num_hidden_layers": 4})  # init=auto
    assert model.loads_weights
    with caplog.at_level(logging.INFO, logger="flexengine.surgery.model"):
        lm = load_model(model, CPU)
    assert lm.config.num_hidden_layers == 3 and lm.config.hidden_size == 48  # the directory's, not model.arch's
    saved = load_file(str(rigged_dir / "model.safetensors"))
    for name, tensor in lm.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    n_params = sum(p.numel() for p in lm.parameters())
    text = caplog.text
    assert str(rigged_dir) in text and f"loaded {len(saved)} tensors" in text and f"{n_params / 1e6:.1f}M" in text


def test_the_loaded_count_is_of_the_files_transformers_reads(rigged_dir, caplog):
    """A stray *.safetensors beside model.safetensors (an adapter, an old export) is not loaded, and the count no
    longer includes it (it reopened every *.safetensors in the directory)."""
    save_file({f"stray.{i}": torch.zeros(2) for i in range(5)}, str(rigged_dir / "adapter_model.safetensors"))
    with caplog.at_level(logging.INFO, logger="flexengine.surgery.model"):
        load_model(ModelConfig(path=str(rigged_dir)), CPU)
    saved = load_file(str(rigged_dir / "model.safetensors"))
    assert f"loaded {len(saved)} tensors" in caplog.text


def test_a_placeholder_says_its_weights_come_from_rank_0(rigged_dir, caplog):
    """Before: a rank > 0 of a pretrained run warned "RANDOM weights ... Nothing pretrained is loaded", although
    rank 0's weights reach it by broadcast."""
    with caplog.at_level(logging.INFO, logger="flexengine.surgery.model"):
        lm = load_model(ModelConfig(path=str(rigged_dir)), CPU, placeholder=True)
    assert lm.config.num_hidden_layers == 3  # the directory's shapes, no weights read
    assert f"its weights come by broadcast from rank 0, which reads {rigged_dir}" in caplog.text
    assert "RANDOM" not in caplog.text and "loaded" not in caplog.text


def test_random_init_only_when_asked_and_said_loudly(rigged_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="flexengine.surgery.model"):
        lm = load_model(ModelConfig(path=str(rigged_dir), init="random"), CPU)
    assert lm.config.num_hidden_layers == 3  # the directory's architecture...
    saved = load_file(str(rigged_dir / "model.safetensors"))
    assert not torch.equal(lm.lm_head.weight, saved["lm_head.weight"])  # ...with fresh weights
    assert "RANDOM weights (model.init=random)" in caplog.text


def test_checkpoint_missing_weights_is_an_error(rigged_dir):
    from safetensors.torch import save_file

    saved = load_file(str(rigged_dir / "model.safetensors"))
    del saved["model.layers.1.mlp.up_proj.weight"]
    save_file(saved, str(rigged_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="not in the checkpoint"):
        load_model(ModelConfig(path=str(rigged_dir)), CPU)


def test_pretrained_without_path_names_the_key():
    with pytest.raises(UserError, match="model.path"):
        ModelConfig(name="deepseek7b", init="pretrained", arch={"model_type": "llama"})


def test_meta_model_allocates_nothing_and_counts_like_the_planner():
    from flexengine.planning.shapes import ModelShape

    arch = dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    config = build_hf_config(ModelConfig(arch=arch))
    lm = build_meta_model(config, torch.bfloat16)
    params = list(lm.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == ModelShape.from_hf_config(config).params  # 7.24e9


def test_training_config_with_model_path_trains_those_weights(tmp_path):
    """Defect 1: `model.path=DIR` on the default config (model=tiny) used to build tiny at random."""
    from flexengine.data.demo import load_demo_tokenizer
    from flexengine.run import build_planned_trainer
    from tests.helpers import make_job

    model = make_llama(num_hidden_layers=3, vocab_size=2048)
    model.save_pretrained(tmp_path / "ckpt")
    load_demo_tokenizer().save_pretrained(tmp_path / "ckpt")
    trainer, run = build_planned_trainer(
        make_job(tmp_path / "run", f"model.path={tmp_path / 'ckpt'}", "train.max_steps=1"), tmp_path / "run"
    )
    assert run.job.model.init == "auto" and run.job.model.loads_weights
    assert len(trainer.model.model.layers) == 3
    torch.testing.assert_close(trainer.model.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_an_arch_key_the_config_class_lacks_is_refused_naming_the_nearest_field():
    """transformers kept `num_hiden_layers` as an attribute no layer reads: the 4-layer model was built unchanged."""
    arch = {"model_type": "llama", "num_hidden_layers": 4, "num_hiden_layers": 2, "hidden_sizee": 64}
    with pytest.raises(UserError) as e:
        build_hf_config(ModelConfig(init="random", arch=arch))
    text = str(e.value)
    assert "model.arch.num_hiden_layers (did you mean model.arch.num_hidden_layers?)" in text
    assert "model.arch.hidden_sizee (did you mean model.arch.hidden_size?)" in text and "LlamaConfig" in text


@pytest.mark.parametrize("path", sorted((conf_dir() / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_arch_key_is_a_field_its_config_class_knows(path):
    """rope_theta, which transformers folds into rope_parameters, included."""
    raw = yaml.safe_load(path.read_text())
    arch = (raw.get("model") or raw)["arch"]
    config = build_hf_config(ModelConfig(init="random", arch=arch))
    assert config.num_hidden_layers == arch["num_hidden_layers"]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_nonfinite_weights_in_model_path_are_named_at_load(rigged_dir, value):
    """Before: they loaded, and the run's later refusal blamed "the last update" for weights that came this way."""
    weights = load_file(rigged_dir / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(weights, rigged_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model.layers.1.mlp.up_proj.weight.*NaN or Inf.*as stored in .*rigged"):
        load_model(ModelConfig(path=str(rigged_dir)), CPU)


def test_a_config_that_needs_remote_code_gets_one_message(rigged_dir):
    """Before: our prefix, transformers' two sentences and a broken https://hf.co//<absolute dir> link."""
    import json

    config = json.loads((rigged_dir / "config.json").read_text())
    config.update(model_type="mycustom", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    (rigged_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as err:
        build_hf_config(ModelConfig(path=str(rigged_dir)))
    message = str(err.value)
    assert "configuration_my.MyConfig" in message and "model.trust_remote_code=true" in message, message
    assert "hf.co" not in message and "repository" not in message and message.count("model.path") == 1, message
