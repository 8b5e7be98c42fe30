"""checkpoint/load.py on its own (tiny model, no trainer): weights-only loading, the manifest's verdict, falling
back to the newest step that verifies, resume selection."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexengine.core import storage
from flexengine.core.errors import UserError
from flexengine.core.storage import list_checkpoints
from flexengine.loop.checkpoint import load as checkpoint_load
from flexengine.loop.checkpoint.load import (
    load_checkpoint_state,
    load_checkpoint_weights,
    load_model_weights,
    load_trainer_state,
    resolve_resume,
    verify_checkpoint,
)
from flexengine.loop.checkpoint.save import save_checkpoint
from tests.helpers import checkpoint_state, flip_one_byte, make_llama, trained_optimizer


def test_checkpoints_are_listed_newest_first_numerically_ignoring_temp_and_foreign_dirs(tmp_path):
    model = make_llama()
    assert list_checkpoints(tmp_path / "missing") == []
    save_checkpoint(tmp_path, 2, model, None, {"train": {}})
    save_checkpoint(tmp_path, 10, model, None, {"train": {}})
    (tmp_path / ".tmp_step_40_host_123").mkdir()  # an interrupted save's temporary directory
    (tmp_path / "step_x").mkdir()
    assert list_checkpoints(tmp_path) == [(10, tmp_path / "step_10"), (2, tmp_path / "step_2")]  # 10 > 2
    assert resolve_resume("auto", tmp_path) == tmp_path / "step_10"


def test_loading_into_a_different_model_names_the_keys(tmp_path):
    path = save_checkpoint(tmp_path, 1, make_llama(), None, {"train": {}})
    deeper = make_llama(num_hidden_layers=3)
    with pytest.raises(UserError, match=r"missing \['model\.layers\.2\."):
        load_model_weights(deeper, path)
    with pytest.raises(UserError, match="no \\*.safetensors"):
        load_model_weights(deeper, tmp_path)


class _Payload:
    """A pickle that runs code when loaded (what a planted trainer_state.pt does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_planted_pickle_payload_is_refused_naming_the_file(run, tmp_path):
    marker = tmp_path / "pwned"
    target = run / "step_2" / "trainer_state.pt"
    state = torch.load(target, weights_only=True)
    state["extra"] = _Payload(marker)
    torch.save(state, target)
    storage.write_manifest(run / "step_2", 2)  # even a consistent manifest (a copied, re-hashed dir) does not help
    with pytest.raises(UserError, match=f"refusing to load {target}: it holds .*tampered") as err:
        load_trainer_state(target)
    assert not marker.exists()
    # before: torch's first line (ANSI colour codes, no global named); now the disallowed global itself
    assert "pathlib" in str(err.value) and "\x1b" not in str(err.value)


def test_a_damaged_trainer_state_is_called_damaged_and_other_errors_propagate(run, monkeypatch):
    target = run / "step_2" / "trainer_state.pt"
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])  # a truncated zip archive
    with pytest.raises(UserError, match=f"{target} is damaged") as err:
        load_trainer_state(target)
    assert "tampered" not in str(err.value)

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(checkpoint_load.torch, "load", out_of_memory)
    with pytest.raises(MemoryError):  # before: reported as "tampered with"
        load_trainer_state(run / "step_1" / "trainer_state.pt")


def test_trainer_state_loads_weights_only_and_round_trips(model, tmp_path):
    import numpy as np

    from flexengine.loop.checkpointer import _set_rng_state

    np.random.seed(3)
    state = checkpoint_state(model, 1)
    expected = np.random.rand(4)
    torch.save(state, tmp_path / "s.pt")
    back = load_trainer_state(tmp_path / "s.pt")  # no numpy globals needed: numpy's RNG travels as a tensor
    _set_rng_state(back["rng"])
    assert np.array_equal(np.random.rand(4), expected)
    opt, _ = trained_optimizer(model)
    opt.load_state_dict(back["optimizer"])


def test_torchao_optimizer_states_are_on_the_allow_list(tmp_path):
    ao = pytest.importorskip("torchao.optim")
    layer = torch.nn.Linear(256, 256)
    opt = ao.AdamW8bit(layer.parameters(), lr=1e-3)
    layer(torch.randn(4, 256)).sum().backward()
    opt.step()
    torch.save({"train": {}, "optimizer": opt.state_dict()}, tmp_path / "s.pt")
    state = load_trainer_state(tmp_path / "s.pt")  # weights_only, with torchao's state subclasses allowed
    again = ao.AdamW8bit(layer.parameters(), lr=1e-3)
    again.load_state_dict(state["optimizer"])
    torch.testing.assert_close(
        again.state[layer.weight]["exp_avg"].dequantize(), opt.state[layer.weight]["exp_avg"].dequantize()
    )


def test_a_file_the_manifest_does_not_list_is_refused_and_never_loaded(run, model):
    """Before: verification checked only the listed files, and loading read every *.safetensors: a file dropped
    into step_2 (zeroed embeddings) was accepted by resume=auto and zeroed the model's embeddings."""
    from safetensors.torch import save_file

    planted = {"model.embed_tokens.weight": torch.zeros_like(model.model.embed_tokens.weight)}
    save_file(planted, str(run / "step_2" / "zz-extra.safetensors"))
    assert "zz-extra.safetensors is not in the manifest" in verify_checkpoint(run / "step_2")
    twin = make_llama(seed=1)
    load_model_weights(twin, run / "step_2")  # a direct load reads only what the manifest lists
    torch.testing.assert_close(twin.model.embed_tokens.weight, model.model.embed_tokens.weight, rtol=0, atol=0)
    assert resolve_resume("auto", run) == run / "step_1"  # the changed step is moved aside, not resumed
    assert (run / "step_2.corrupt" / "zz-extra.safetensors").is_file()


def test_a_checkpoint_of_an_older_flexengine_is_refused_not_moved_aside(run):
    """Before: a step without manifest.json (written before checksums existed) was renamed to step_N.corrupt."""
    (run / "step_2" / "manifest.json").unlink()
    for spec in ("auto", str(run / "step_2")):
        with pytest.raises(UserError, match="older flexengine.*model.path=.*step_2 with a new train.output_dir"):
            resolve_resume(spec, run)
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]


def test_a_malformed_manifest_entry_is_a_verification_problem(run):
    manifest = json.loads((run / "step_2" / "manifest.json").read_text())
    manifest["files"]["config.json"] = "not a dict"
    (run / "step_2" / "manifest.json").write_text(json.dumps(manifest))
    assert "is not a valid manifest" in verify_checkpoint(run / "step_2")


def test_corrupt_newest_checkpoint_falls_back_to_the_newest_that_verifies(run, caplog):
    bad = run / "step_2" / "model.safetensors"
    flip_one_byte(bad)
    assert "does not match its checksum" in verify_checkpoint(run / "step_2")
    with caplog.at_level(logging.WARNING, logger="flexengine.loop.checkpoint.load"):
        chosen = resolve_resume("auto", run)
    assert chosen == run / "step_1"
    assert f"{bad} does not match its checksum" in caplog.text and "falling back to" in caplog.text
    assert (run / "step_2.corrupt" / "model.safetensors").is_file()  # kept for inspection, out of the way
    twin = make_llama(seed=1)
    assert load_checkpoint_state(chosen)["train"]["step"] == 1
    load_checkpoint_weights(chosen, twin)
    saved = load_file(str(chosen / "model.safetensors"))
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_no_verifying_checkpoint_fails_clearly(run):
    for step in (1, 2):
        (run / f"step_{step}" / "trainer_state.pt").write_bytes(b"truncated")
    with pytest.raises(UserError, match="no checkpoint under .* verifies.*step_2: .*step_1: "):
        resolve_resume("auto", run)


def test_explicit_damaged_checkpoint_is_refused_naming_the_file(run):
    (run / "step_1" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="step_1/model.safetensors is missing"):
        resolve_resume(str(run / "step_1"), run)


def test_resume_auto_without_output_dir_says_so(tmp_path):
    with pytest.raises(UserError, match="without train.output_dir"):
        resolve_resume("auto", tmp_path / "checkpoints", explicit_output_dir=False)
    assert resolve_resume("auto", tmp_path / "checkpoints", explicit_output_dir=True) is None
