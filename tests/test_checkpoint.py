"""checkpoint.py on its own: the HF directory it writes, atomic replacement, finding the latest, loading back."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from flexengine.checkpoint import (
    TRAINER_STATE,
    find_latest_checkpoint,
    load_model_weights,
    load_trainer_state,
    save_checkpoint,
    write_json_atomic,
)
from tests.helpers import make_llama


def test_saved_directory_is_standard_hf_and_loads_back_exactly(tmp_path):
    model = make_llama(seed=1)
    state = {"train": {"step": 7}, "rng": torch.get_rng_state()}
    path = save_checkpoint(tmp_path, 7, model, None, state)
    assert path == tmp_path / "step_7" and (path / "config.json").is_file() and (path / TRAINER_STATE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["step_7"]  # no temporary directory left behind
    hf = AutoModelForCausalLM.from_pretrained(path)  # transformers' own loader, not ours
    for (name, ours), theirs in zip(model.state_dict().items(), hf.state_dict().values()):
        torch.testing.assert_close(theirs, ours, rtol=0, atol=0, msg=name)
    fresh = make_llama(seed=2)
    load_model_weights(fresh, path)
    for name, p in fresh.state_dict().items():
        torch.testing.assert_close(p, model.state_dict()[name], rtol=0, atol=0, msg=name)
    loaded = load_trainer_state(path)
    assert loaded["train"] == {"step": 7} and torch.equal(loaded["rng"], state["rng"])


def test_model_state_argument_is_what_gets_written(tmp_path):
    # FSDP passes a gathered full state dict: the file must hold it, not the (sharded) module's own tensors
    model = make_llama(seed=1)
    other = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    path = save_checkpoint(tmp_path, 1, model, None, {}, model_state=other)
    fresh = make_llama(seed=2)
    load_model_weights(fresh, path)
    assert all(bool((p == 0.5).all()) for p in fresh.state_dict().values())


def test_resaving_a_step_replaces_it_and_latest_ignores_incomplete_dirs(tmp_path):
    model = make_llama()
    assert find_latest_checkpoint(tmp_path / "missing") is None
    assert find_latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 2, model, None, {"v": 1})
    save_checkpoint(tmp_path, 10, model, None, {"v": 1})
    save_checkpoint(tmp_path, 10, model, None, {"v": 2})  # the final save right after a periodic one
    assert load_trainer_state(tmp_path / "step_10") == {"v": 2}
    (tmp_path / "step_30").mkdir()  # a crash before the trainer state was written: not complete
    (tmp_path / ".tmp_step_40_123").mkdir()  # an interrupted save's temporary directory
    (tmp_path / "step_x").mkdir()
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_10"  # 10 > 2 numerically, not as text


def test_loading_into_a_different_model_names_the_keys(tmp_path):
    path = save_checkpoint(tmp_path, 1, make_llama(), None, {})
    deeper = make_llama(num_hidden_layers=3)
    with pytest.raises(RuntimeError, match=r"missing \['model\.layers\.2\."):
        load_model_weights(deeper, path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model_weights(deeper, tmp_path)


def test_write_json_atomic(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"a": 1, "p": tmp_path})  # non-JSON values are written as strings
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
