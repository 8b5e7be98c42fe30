"""checkpoint.py and storage.py on their own (tiny model, no trainer): the HF directory, weights-only loading,
manifest + fallback, temp dirs, free space, output-directory safety, filesystem errors."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flexengine import checkpoint as ckpt
from flexengine import storage
from flexengine.checkpoint import (
    TRAINER_STATE,
    load_checkpoint,
    load_model_weights,
    load_trainer_state,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from flexengine.errors import UserError, os_error_message
from flexengine.storage import check_output_dir, clean_stale_temp_dirs, list_checkpoints, write_json_atomic
from tests.helpers import make_llama


def _optimizer_state(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(input_ids=torch.randint(0, 256, (1, 8))).logits.sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return opt, sched


def _state(model: torch.nn.Module, step: int) -> dict:
    from flexengine.trainer import _rng_state

    opt, sched = _optimizer_state(model)
    return {"train": {"step": step, "losses": [0.0] * step}, "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "data": {"epoch": 0, "cursor": step}, "rng": _rng_state()}


@pytest.fixture
def model():
    return make_llama()


@pytest.fixture
def run(tmp_path, model) -> Path:
    """checkpoints/step_1 and step_2 of a tiny model."""
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, model, None, _state(model, step))
    return root


# -- the HF directory -----------------------------------------------------------------------------------------------

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
    loaded = load_trainer_state(path / TRAINER_STATE)
    assert loaded["train"] == {"step": 7} and torch.equal(loaded["rng"], state["rng"])


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


def test_write_json_atomic(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"a": 1, "p": tmp_path})  # non-JSON values are written as strings
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# -- 1. weights_only ---------------------------------------------------------------------------------------------

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
    with pytest.raises(UserError, match=f"refusing to load {target}.*tampered"):
        load_trainer_state(target)
    assert not marker.exists()


def test_trainer_state_loads_weights_only_and_round_trips(model, tmp_path):
    import numpy as np

    from flexengine.trainer import _set_rng_state

    np.random.seed(3)
    state = _state(model, 1)
    expected = np.random.rand(4)
    torch.save(state, tmp_path / "s.pt")
    back = load_trainer_state(tmp_path / "s.pt")  # no numpy globals needed: numpy's RNG travels as a tensor
    _set_rng_state(back["rng"])
    assert np.array_equal(np.random.rand(4), expected)
    opt, _ = _optimizer_state(model)
    opt.load_state_dict(back["optimizer"])


# -- 6. manifest, checksums, fallback ---------------------------------------------------------------------------

def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data: a finite value changes, the file still parses
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_its_checksum(run):
    import json

    manifest = json.loads((run / "step_2" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "generation_config.json", "model.safetensors",
                                      "trainer_state.pt"}
    assert manifest["files"]["model.safetensors"]["sha256"] == storage.sha256_file(run / "step_2" / "model.safetensors")
    assert verify_checkpoint(run / "step_2") is None


def test_corrupt_newest_checkpoint_falls_back_to_the_newest_that_verifies(run, caplog):
    bad = run / "step_2" / "model.safetensors"
    _flip_one_byte(bad)
    assert "does not match its checksum" in verify_checkpoint(run / "step_2")
    with caplog.at_level(logging.WARNING, logger="flexengine.checkpoint"):
        chosen = resolve_resume("auto", run)
    assert chosen == run / "step_1"
    assert f"{bad} does not match its checksum" in caplog.text and "falling back to" in caplog.text
    assert (run / "step_2.corrupt" / "model.safetensors").is_file()  # kept for inspection, out of the way
    twin = make_llama(seed=1)
    assert load_checkpoint(chosen, twin)["train"]["step"] == 1
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


# -- 5. temp dirs and free space -----------------------------------------------------------------------------------

def test_stale_temp_dirs_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".tmp_step_5_{host}_{dead.pid}"
    alive = tmp_path / f".tmp_step_6_{host}_{os.getppid()}"
    foreign = tmp_path / f".tmp_step_7_otherhost_{dead.pid}"
    for d in (stale, alive, foreign):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    assert clean_stale_temp_dirs(tmp_path) == [stale]
    assert not stale.exists() and alive.exists() and foreign.exists()


def test_disk_full_is_checked_before_writing(run, model, monkeypatch):
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: _Usage(free=2**20))
    with pytest.raises(UserError, match=r"disk full at .*checkpoints \(needs 0\.\d\d GiB, 0\.00 free\)"):
        save_checkpoint(run, 3, model, None, _state(model, 3))
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]  # nothing left behind


def test_disk_full_while_writing_frees_the_partial_save(run, model, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(UserError, match="disk full at .*checkpoints"):
        save_checkpoint(run, 3, model, None, {"train": {}, "optimizer": {}})
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]
    assert verify_checkpoint(run / "step_2") is None  # the previous checkpoint is intact


class _Usage:
    def __init__(self, free: int):
        self.total, self.used, self.free = 2**40, 2**40 - free, free


# -- 2. never destroy or mix runs ------------------------------------------------------------------------------------

def test_a_step_is_never_overwritten(run, model):
    before = (run / "step_2" / "model.safetensors").read_bytes()
    with pytest.raises(UserError, match="never overwrites"):
        save_checkpoint(run, 2, model, None, _state(model, 2))
    assert (run / "step_2" / "model.safetensors").read_bytes() == before


def test_output_dir_holding_a_run_is_refused_unless_resumed(run):
    out = run.parent
    with pytest.raises(UserError, match="already holds a run .*train.resume=auto"):
        check_output_dir(out, None)
    check_output_dir(out, "auto")  # continuing that run is fine
    with pytest.raises(UserError, match="later checkpoints \\(step_2\\)"):
        check_output_dir(out, str(run / "step_1"))
    check_output_dir(out.parent / "new", str(run / "step_1"))  # branching into a new directory is fine
    (out.parent / "finished").mkdir()
    (out.parent / "finished" / "summary.json").write_text("{}")
    with pytest.raises(UserError, match="finished run without checkpoints"):
        check_output_dir(out.parent / "finished", "auto")


# -- 7. filesystem errors ----------------------------------------------------------------------------------------------

def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("")
    with pytest.raises(UserError, match=f"{tmp_path / 'out'} is a file, not a directory"):
        check_output_dir(tmp_path / "out", None)


def test_read_only_output_dir_is_one_paragraph_naming_the_path(tmp_path, monkeypatch):
    def read_only(self, data):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "write_bytes", read_only)  # root ignores chmod; a read-only mount is simulated
    with pytest.raises(UserError) as err:
        check_output_dir(tmp_path / "out", None)
    message = str(err.value)
    assert f"failed at {tmp_path / 'out'}/.write_test_" in message and "Read-only file system" in message
    assert "\n" not in message


def test_os_error_message_names_both_paths():
    e = OSError(errno.EACCES, "Permission denied", "/a", None, "/b")
    assert os_error_message(e, "renaming") == ("renaming failed at /a -> /b: Permission denied; check its "
                                              "permissions, or choose a directory you can write (e.g. "
                                              "train.output_dir=...).")


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
    torch.testing.assert_close(again.state[layer.weight]["exp_avg"].dequantize(),
                               opt.state[layer.weight]["exp_avg"].dequantize())
