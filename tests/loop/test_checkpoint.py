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

from flexengine.core import storage
from flexengine.core.errors import UserError, os_error_message
from flexengine.core.storage import check_output_dir, clean_stale_temp_dirs, list_checkpoints, write_json_atomic
from flexengine.loop import checkpoint as ckpt
from flexengine.loop.checkpoint import (
    TRAINER_STATE,
    load_checkpoint,
    load_model_weights,
    load_trainer_state,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from tests.helpers import flip_one_byte, make_llama


def _optimizer_state(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(input_ids=torch.randint(0, 256, (1, 8))).logits.sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return opt, sched


def _state(model: torch.nn.Module, step: int) -> dict:
    from flexengine.loop.checkpointer import _rng_state

    opt, sched = _optimizer_state(model)
    return {
        "train": {"step": step, "losses": [0.0] * step},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "data": {"epoch": 0, "cursor": step},
        "rng": _rng_state(),
    }


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

    monkeypatch.setattr(ckpt.torch, "load", out_of_memory)
    with pytest.raises(MemoryError):  # before: reported as "tampered with"
        load_trainer_state(run / "step_1" / "trainer_state.pt")


def test_trainer_state_loads_weights_only_and_round_trips(model, tmp_path):
    import numpy as np

    from flexengine.loop.checkpointer import _set_rng_state

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


def test_manifest_lists_every_file_with_its_checksum(run):
    manifest = json.loads((run / "step_2" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "generation_config.json", "model.safetensors", "trainer_state.pt"}
    assert manifest["files"]["model.safetensors"]["sha256"] == storage.sha256_file(run / "step_2" / "model.safetensors")
    assert verify_checkpoint(run / "step_2") is None


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
    monkeypatch.setattr(ckpt.os, "replace", replace)
    path = save_checkpoint(tmp_path, 1, model, None, _state(model, 1))
    tmp_name = next(Path(p).name for p in synced if Path(p).name.startswith(".tmp_step_1_"))
    before_rename = synced[: renamed_after[-1]]
    for name in json.loads((path / "manifest.json").read_text())["files"]:
        assert any(p.endswith(f"/{tmp_name}/{name}") for p in before_rename), name
    assert any(f"/{tmp_name}/.manifest.json.tmp_" in p for p in before_rename)
    assert str(tmp_path / tmp_name) in before_rename  # the directory's entries
    assert str(tmp_path) in synced[renamed_after[-1] :]  # the rename itself


def test_corrupt_newest_checkpoint_falls_back_to_the_newest_that_verifies(run, caplog):
    bad = run / "step_2" / "model.safetensors"
    flip_one_byte(bad)
    assert "does not match its checksum" in verify_checkpoint(run / "step_2")
    with caplog.at_level(logging.WARNING, logger="flexengine.loop.checkpoint_load"):
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


def test_stale_temp_dirs_of_dead_processes_are_removed(tmp_path, caplog):
    """Before: a dir named with this process's pid was skipped (in a container the trainer is PID 1 on every
    start, so it stayed forever) and another host's was never removed, even by a requeued resume=auto job."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".tmp_step_5_{host}_{dead.pid}"
    alive = tmp_path / f".tmp_step_6_{host}_{os.getppid()}"
    own = tmp_path / f".tmp_step_8_{host}_{os.getpid()}"  # an earlier process with our pid (nothing saved yet)
    foreign = tmp_path / f".tmp_step_7_otherhost_{dead.pid}"
    for d in (stale, alive, own, foreign):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    with caplog.at_level(logging.WARNING, logger="flexengine.core.storage"):
        assert clean_stale_temp_dirs(tmp_path) == [stale, own]
    assert alive.exists() and foreign.exists() and "left by host otherhost" in caplog.text
    assert "held by unfinished saves (.tmp_step_6_" in storage.disk_full_message(tmp_path, 2**30, 0)
    assert clean_stale_temp_dirs(tmp_path, owned=True) == [foreign]  # resume=auto: a requeue on another node
    assert alive.exists()


def test_disk_full_is_checked_before_writing(run, model, monkeypatch):
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: _Usage(free=2**20))
    with pytest.raises(UserError, match=r"disk full at .*checkpoints \(needs 0\.\d\d GiB, 0\.00 free\)"):
        save_checkpoint(run, 3, model, None, _state(model, 3))
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
        monkeypatch.setattr(ckpt.torch, "save", fill_the_disk(RuntimeError(_TORCH_WRITE_FAILED)))
    else:
        full = fill_the_disk(SafetensorError(_SAFETENSORS_FULL))
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(UserError, match=r"^disk full at .*checkpoints \(needs 0\.\d\d GiB, 0\.00 free\)"):
        save_checkpoint(run, 3, model, None, _state(model, 3))
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]
    assert verify_checkpoint(run / "step_2") is None  # the previous checkpoint is intact


def test_a_write_error_on_a_disk_with_space_is_not_called_disk_full(run, model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError(_TORCH_WRITE_FAILED)

    monkeypatch.setattr(ckpt.torch, "save", broken)
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
    become `disk full at PATH (needs X GiB, Y free)`, and the partial save is removed."""
    model = make_llama()  # 0.4 MB of fp32 weights, then a 0.5 MB trainer state
    monkeypatch.setattr(ckpt, "check_free_space", lambda root, needed: None)
    ballast = small_disk / "ballast"
    if fills_in == "model.safetensors":
        ballast.write_bytes(b"x" * (512 << 10))  # the weights no longer fit
    state = {"train": {}, "optimizer": {"exp_avg": torch.zeros(128 << 10)}}
    root = small_disk / "checkpoints"
    with pytest.raises(UserError, match=r"^disk full at .*checkpoints \(needs 0\.\d\d GiB"):
        save_checkpoint(root, 1, model, None, state)
    assert list(root.iterdir()) == []  # the partial save is gone


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
    assert os_error_message(e, "renaming") == (
        "renaming failed at /a -> /b: Permission denied; check its "
        "permissions, or choose a directory you can write (e.g. "
        "train.output_dir=...)."
    )


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
    estimate = sum(ckpt.stored_bytes(t) for t in states)
    assert 0.9 * on_disk < estimate <= on_disk, (estimate, on_disk)


# -- every rank fails together, none hangs (2 processes, gloo) ---------------------------------------------------


def _two_ranks(rank: int, init_file: str, out: str) -> None:
    """Each phase records how this rank ended and how long it took. The job's own collectives time out after
    3 s; the checkpoint's waits go through their own group (rank 0 hashes for 5 s in phase "slow_hash")."""
    import datetime
    import time

    import torch.distributed as dist

    from flexengine.core import storage
    from flexengine.loop import checkpoint, rank_sync

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3)
    )
    rank_sync.COLLECTIVE_TIMEOUT_S = 60.0  # a hang fails the test in a minute (the save and the load read it)
    root, model, results = Path(out) / "checkpoints", make_llama(), {}

    def phase(name, fn):
        start = time.perf_counter()
        try:
            fn()
            results[name] = ["ok", ""]
        except Exception as e:
            results[name] = [type(e).__name__, str(e)]
        results[name].append(time.perf_counter() - start)

    real_hash, real_save, real_temp = storage.sha256_file, torch.save, checkpoint.temp_dir_name

    def slow_hash(path):
        time.sleep(5)
        return real_hash(path)

    def rank1_cannot_write(obj, f, *args, **kwargs):
        raise OSError(errno.EACCES, "Permission denied", str(f))

    def rank0_bug(step):
        raise TypeError("a bug on rank 0")

    if rank == 0:
        storage.sha256_file = slow_hash
    phase("slow_hash", lambda: save_checkpoint(root, 1, model, None, {"train": {"step": 1}}))
    storage.sha256_file = real_hash
    if rank == 1:
        torch.save = rank1_cannot_write
    phase("rank1_write", lambda: save_checkpoint(root, 2, model, None, {"train": {"step": 2}}))
    torch.save = real_save
    if rank == 0:
        checkpoint.temp_dir_name = rank0_bug
    phase("rank0_bug", lambda: save_checkpoint(root, 3, model, None, {"train": {"step": 3}}))
    checkpoint.temp_dir_name = real_temp
    dist.barrier()
    if rank == 1:
        (root / "step_1" / "trainer_state.rank1.pt").unlink()
    dist.barrier()
    phase("rank1_load", lambda: checkpoint.load_checkpoint(root / "step_1", make_llama(seed=1)))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_failure_on_one_rank_fails_every_rank_without_a_hang(tmp_path):
    """Before: rank 0's hashing ran inside a wait on the job's group (NCCL: 10 minutes), a non-UserError on
    rank 0 (OSError, a bug) left the other ranks waiting for a broadcast that never came, and load_checkpoint
    had no agreement step (a missing rank file failed one rank while the others went on into collectives)."""
    import torch.multiprocessing as mp

    mp.spawn(_two_ranks, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["slow_hash"][0] == r1["slow_hash"][0] == "ok"  # 5 s of hashing outlasts the 3 s job timeout
    manifest = json.loads((tmp_path / "checkpoints" / "step_1" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and "trainer_state.rank1.pt" in manifest["files"]  # each rank's file
    assert r1["rank1_write"][0] == "UserError"
    assert r1["rank1_write"][1].startswith(f"saving a checkpoint failed at {tmp_path}/checkpoints/.tmp_step_2_")
    assert r1["rank1_write"][1].endswith(
        "/trainer_state.rank1.pt: Permission denied; check its permissions, or "
        "choose a directory you can write (e.g. train.output_dir=...)."
    )
    assert r0["rank1_write"][0] == "UserError" and r0["rank1_write"][1].startswith("rank 1: saving a checkpoint")
    assert r0["rank0_bug"][:2] == ["TypeError", "a bug on rank 0"]  # its own exception, with its traceback
    assert r1["rank0_bug"][0] == "UserError" and "rank 0: preparing" in r1["rank0_bug"][1]
    assert r1["rank1_load"][0] == "UserError" and "trainer_state.rank1.pt is missing" in r1["rank1_load"][1]
    assert r0["rank1_load"][0] == "UserError" and r0["rank1_load"][1].startswith("rank 1: ")
    for name in ("rank1_write", "rank0_bug", "rank1_load"):
        assert r0[name][2] < 20 and r1[name][2] < 20, name  # seconds: no rank waited for a timeout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]  # no partial save left


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
