"""checkpoint/save.py on its own (tiny model, no trainer): the HF directory and its manifest, fsync before the
rename, free space and a disk that fills, no step overwritten, the size estimate, exports that drop in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flexengine.core import storage
from flexengine.core.errors import UserError
from flexengine.loop.checkpoint import save as checkpoint_save
from flexengine.loop.checkpoint.load import (
    TRAINER_STATE,
    load_model_weights,
    load_trainer_state,
    verify_checkpoint,
)
from flexengine.loop.checkpoint.save import save_checkpoint
from tests.helpers import checkpoint_state, make_llama


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


def test_manifest_lists_every_file_with_its_checksum(run):
    manifest = json.loads((run / "step_2" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "generation_config.json", "model.safetensors", "trainer_state.pt"}
    assert manifest["files"]["model.safetensors"]["sha256"] == storage.sha256_file(run / "step_2" / "model.safetensors")
    assert verify_checkpoint(run / "step_2") is None


def test_every_file_and_directory_is_fsynced_before_the_rename(tmp_path, model, monkeypatch):
    """Before: nothing was fsynced; after a power cut the renamed step could hold empty or partial files."""
    synced = []
    real_fsync = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    real_replace = os.replace
    renamed_after = []

    def replace(src, dst):
        renamed_after.append(len(synced))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", record)
    monkeypatch.setattr(checkpoint_save.os, "replace", replace)
    path = save_checkpoint(tmp_path, 1, model, None, checkpoint_state(model, 1))
    tmp_name = next(Path(p).name for p in synced if Path(p).name.startswith(".tmp_step_1_"))
    before_rename = synced[: renamed_after[-1]]
    for name in json.loads((path / "manifest.json").read_text())["files"]:
        assert any(p.endswith(f"/{tmp_name}/{name}") for p in before_rename), name
    assert any(f"/{tmp_name}/.manifest.json.tmp_" in p for p in before_rename)
    assert str(tmp_path / tmp_name) in before_rename  # the directory's entries
    assert str(tmp_path) in synced[renamed_after[-1] :]  # the rename itself


def test_a_step_is_never_overwritten(run, model):
    before = (run / "step_2" / "model.safetensors").read_bytes()
    with pytest.raises(UserError, match="never overwrites"):
        save_checkpoint(run, 2, model, None, checkpoint_state(model, 2))
    assert (run / "step_2" / "model.safetensors").read_bytes() == before


def test_disk_full_is_checked_before_writing(run, model, monkeypatch):
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: _Usage(free=2**20))
    with pytest.raises(UserError, match=r"disk full at .*checkpoints \(needs [\d.]+ MiB, [\d.]+ MiB free\)"):
        save_checkpoint(run, 3, model, None, checkpoint_state(model, 3))
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]  # nothing left behind


_TORCH_WRITE_FAILED = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # torch.save, full disk


_SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.mark.parametrize("writer", ["torch.save", "safetensors"])
def test_disk_full_while_writing_frees_the_partial_save(run, model, monkeypatch, writer):
    """The exceptions the writers really raise when the disk fills (measured on a full tmpfs): torch.save's zip
    writer a RuntimeError without errno, safetensors a SafetensorError. Before, only OSError(ENOSPC) was
    recognised, so a real full disk gave `saving the checkpoint ... failed: RuntimeError: [enforce fail ...`."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    usage = {"free": 2**40}
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: _Usage(usage["free"]))

    def fill_the_disk(error):
        def write(*args, **kwargs):
            usage["free"] = 4096  # another writer took the space after the check
            raise error

        return write

    if writer == "torch.save":
        monkeypatch.setattr(checkpoint_save.torch, "save", fill_the_disk(RuntimeError(_TORCH_WRITE_FAILED)))
    else:
        full = fill_the_disk(SafetensorError(_SAFETENSORS_FULL))
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(UserError, match=r"^disk full at .*checkpoints \(needs [\d.]+ MiB, [\d.]+ MiB free\)"):
        save_checkpoint(run, 3, model, None, checkpoint_state(model, 3))
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]
    assert verify_checkpoint(run / "step_2") is None  # the previous checkpoint is intact


def test_a_write_error_on_a_disk_with_space_is_not_called_disk_full(run, model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError(_TORCH_WRITE_FAILED)

    monkeypatch.setattr(checkpoint_save.torch, "save", broken)
    with pytest.raises(UserError, match=r"saving the checkpoint into .* failed: RuntimeError: \[enforce fail") as err:
        save_checkpoint(run, 3, model, None, {"train": {}, "optimizer": {}})
    assert "disk full" not in str(err.value)
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 768 KiB file system (tmpfs); skipped where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=768k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # a failed writer may still hold a file


@pytest.mark.parametrize("fills_in", ["model.safetensors", "trainer_state.pt"])
def test_a_really_full_disk_is_reported_with_numbers(small_disk, monkeypatch, fills_in):
    """The disk fills after the free-space check (another writer): the real errors of safetensors and torch.save
    become `disk full at PATH (needs X MiB, Y MiB free)`, and the partial save is removed."""
    model = make_llama()  # 0.4 MB of fp32 weights, then a 0.5 MB trainer state
    monkeypatch.setattr(checkpoint_save, "check_free_space", lambda root, needed: None)
    ballast = small_disk / "ballast"
    if fills_in == "model.safetensors":
        ballast.write_bytes(b"x" * (512 << 10))  # the weights no longer fit
    state = {"train": {}, "optimizer": {"exp_avg": torch.zeros(128 << 10)}}
    root = small_disk / "checkpoints"
    with pytest.raises(UserError, match=r"^disk full at .*checkpoints \(needs [\d.]+ MiB"):
        save_checkpoint(root, 1, model, None, state)
    assert list(root.iterdir()) == []  # the partial save is gone


class _Usage:
    def __init__(self, free: int):
        self.total, self.used, self.free = 2**40, 2**40 - free, free


def test_size_estimate_counts_the_bytes_torchao_states_store(tmp_path):
    """Before: numel() * element_size() of OptimState8bit is its apparent fp32 size, 4x what it stores (8x for
    4-bit), so with optim=adamw_8bit the first save could be refused as a full disk."""
    ao = pytest.importorskip("torchao.optim")
    layer = torch.nn.Linear(512, 512)
    opt = ao.AdamW8bit(layer.parameters(), lr=1e-3)
    layer(torch.randn(4, 512)).sum().backward()
    opt.step()
    states = [v for s in opt.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    on_disk = (tmp_path / "opt.pt").stat().st_size
    estimate = sum(checkpoint_save.stored_bytes(t) for t in states)
    assert 0.9 * on_disk < estimate <= on_disk, (estimate, on_disk)


# Loads the exports with plain transformers / peft (no flexengine) and generates with the KV cache.
_LOAD_AND_GENERATE = """
import json, sys
from pathlib import Path
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

def generate(model):
    assert model.config.use_cache is True and model.generation_config.use_cache is True
    out = model.generate(torch.tensor([[5, 9, 17]]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True)
    assert out.sequences.shape == (1, 7) and out.get("cache") is not None  # generated with the KV cache

full, lora = map(Path, sys.argv[1:])
generate(AutoModelForCausalLM.from_pretrained(full))
generate(AutoModelForCausalLM.from_pretrained(lora / "merged"))
base = json.loads((lora / "adapter_config.json").read_text())["base_model_name_or_path"]
assert Path(base).is_absolute(), base
generate(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), lora))
print("ok")
"""


def test_exports_drop_in_from_another_directory(tmp_path, monkeypatch):
    """A full checkpoint, a LoRA adapter and its merged/ copy, from a run launched with a relative model.path, load
    with plain transformers / peft from another working directory and generate with the KV cache on (the exported
    config.json and generation_config.json say use_cache: true; the adapter names its base by an absolute path).
    Training keeps the cache off."""
    from flexengine.data.demo import load_demo_tokenizer
    from flexengine.run import build_trainer
    from tests.helpers import DEBUG_FAST, make_job

    make_llama(vocab_size=2048, use_cache=True).save_pretrained(tmp_path / "base")  # as a downloaded model is
    load_demo_tokenizer().save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    steps = []
    for name, extra in (("full", ()), ("lora", ("model.lora.r=4", "train.merge_lora_on_save=true"))):
        trainer = build_trainer(
            make_job(tmp_path / name, *DEBUG_FAST, "model.path=base", "train.max_steps=1", *extra), tmp_path / name
        )
        trainer.train()
        assert trainer.model.config.use_cache is False  # the live model trains as before
        steps.append(str(tmp_path / name / "checkpoints" / "step_1"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_GENERATE, *steps], cwd=elsewhere, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_pruning_skips_a_symlinked_step_with_a_warning(tmp_path, caplog):
    """Before: shutil.rmtree on a linked step_N raised OSError at the first keep_last prune and killed the run."""
    from flexengine.loop.checkpoint.save import prune_checkpoints

    root, elsewhere = tmp_path / "checkpoints", tmp_path / "elsewhere"
    for d in (root / "step_2", root / "step_3", elsewhere):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"w")
    (root / "step_1").symlink_to(elsewhere, target_is_directory=True)
    with caplog.at_level("WARNING"):
        deleted = prune_checkpoints(root, keep_last=1)
    assert deleted == [root / "step_2"]
    assert (elsewhere / "model.safetensors").read_bytes() == b"w" and (root / "step_1").is_symlink()
    assert f"{root / 'step_1'} is a symbolic link" in caplog.text


@pytest.mark.parametrize(
    "error",
    [OSError(27, "File too large"), RuntimeError(_TORCH_WRITE_FAILED)],  # write(2)'s EFBIG; torch.save's short write
)
def test_a_file_size_limit_is_reported_like_a_full_disk(run, model, monkeypatch, error):
    """Under `ulimit -f` torch.save reported `[enforce fail at inline_container.cc:672] unexpected pos ...`."""
    import resource

    monkeypatch.setattr(checkpoint_save.resource, "getrlimit", lambda what: (8 << 20, resource.RLIM_INFINITY))

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(checkpoint_save.torch, "save", broken)
    limit = r"this process may write files of at most 8\.0 MiB \(ulimit -f\).*ulimit -f unlimited"
    with pytest.raises(UserError, match=rf"^saving the checkpoint into .*checkpoints hit the file-size limit: {limit}"):
        save_checkpoint(run, 3, model, None, checkpoint_state(model, 3))
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]


def test_a_link_planted_at_the_temp_dir_name_is_not_written_through(run, model, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / storage.temp_dir_name(3)).symlink_to(elsewhere, target_is_directory=True)
    path = save_checkpoint(run, 3, model, None, checkpoint_state(model, 3))
    assert not list(elsewhere.iterdir()) and verify_checkpoint(path) is None
