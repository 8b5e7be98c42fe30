"""core/storage.py: the run directory's advisory lock across real processes (a second run on a directory a live run
holds is refused before it writes, checks or truncates anything), output-directory safety, stale temp dirs, atomic
JSON, and filesystem errors as one paragraph naming the path."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flexengine.core import storage
from flexengine.core.errors import OutputDirTaken, UserError
from flexengine.core.storage import (
    RUN_LOCK,
    check_output_dir,
    clean_stale_temp_dirs,
    hold_output_dir,
    write_json_atomic,
)

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from flexengine.core.storage import hold_output_dir
    with hold_output_dir(Path(sys.argv[1]), None):
        print("held", flush=True)
        time.sleep(120)
    """
)


@pytest.fixture
def live_run(tmp_path):
    """Another process holding tmp_path/out as a live run would: (its directory, its pid)."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield out, proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_process_is_refused_naming_the_dir_and_the_holders_pid(live_run):
    out, proc = live_run
    taken = rf"train.output_dir={out} is in use by a live run \(pid {proc.pid} "
    with pytest.raises(OutputDirTaken, match=taken), hold_output_dir(out, None):
        pass
    running = rf"train.resume=auto: the run in {out} is still running \(pid {proc.pid}"
    with pytest.raises(OutputDirTaken, match=running), hold_output_dir(out, "auto"):
        pass


def test_the_lock_goes_with_its_process_however_it_ends(live_run):
    out, proc = live_run
    proc.kill()  # SIGKILL: no cleanup ran; the kernel released the lock
    proc.wait()
    with hold_output_dir(out, "auto"):
        assert (out / RUN_LOCK).read_text().startswith("pid ")


def test_the_lock_is_released_at_the_end_of_a_run_in_this_process(tmp_path):
    out = tmp_path / "out"
    # a second open file description conflicts, even in one process
    with hold_output_dir(out, None), pytest.raises(OutputDirTaken), hold_output_dir(out, None):
        pass
    with hold_output_dir(out, "auto"):  # the next run (a resume) gets it
        pass
    with hold_output_dir(out, None, enabled=False):  # ranks > 0 take nothing
        pass


def test_resume_auto_beside_a_live_run_is_refused_and_leaves_its_records(live_run):
    from flexengine.cli.common import compose_job
    from flexengine.run import run_training

    out, proc = live_run
    records = '{"step": 1, "loss": 7.0}\n{"step": 2, "loss": 6.9}\n'
    (out / "metrics.jsonl").write_text(records)
    job = compose_job(["debug=fast", f"train.output_dir={out}", "train.resume=auto"])
    with pytest.raises(OutputDirTaken, match=rf"pid {proc.pid}"):
        run_training(job, out)
    assert (out / "metrics.jsonl").read_text() == records  # a resume used to truncate the live run's records
    assert [json.loads(line)["step"] for line in records.splitlines()] == [1, 2]


def test_two_training_runs_started_together_one_is_refused(tmp_path):
    """Two real `flexengine.train` processes on one train.output_dir: exactly one trains, the other exits 2
    with the lock's message and writes nothing there."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "flexengine.train",
        "debug=fast",
        "train.max_steps=3",
        "train.progress=false",
        f"train.output_dir={out}",
    ]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, err in results]
    refused = next(err for code, err in results if code == 2)
    assert "in use by a live run" in refused or "already holds a run" in refused, refused[-2000:]
    assert not (out / "error.json").exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == sorted(set(steps)), steps  # one run's records, not two interleaved
    assert not (tmp_path / "outputs").exists()  # Hydra's files went to train.output_dir
    launches = sorted(out.glob("*/*/.hydra/config.yaml"))  # <date>/<time>/ per launch: neither overwrote the other
    assert 1 <= len(launches) <= 2 and all((p.parent.parent / "train.log").is_file() for p in launches)


@pytest.mark.parametrize("name", ["../outside.bin", "/abs/outside.bin", "a/../../outside.bin", "./x"])
def test_a_manifest_naming_files_outside_its_checkpoint_is_refused(tmp_path, name):
    """Before: such names were hashed (reading any file the user can read) and the checkpoint verified."""
    from flexengine.core.storage import MANIFEST, read_manifest, sha256_file, verify_manifest, write_manifest

    step = tmp_path / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"weights")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    manifest = write_manifest(step, 1)
    manifest["files"][name] = {"bytes": 6, "sha256": sha256_file(outside)}
    (step / MANIFEST).write_text(json.dumps(manifest))
    problem = verify_manifest(step)
    assert problem is not None and "names files outside its checkpoint" in problem and repr(name) in problem
    with pytest.raises(UserError, match="outside its checkpoint"):
        read_manifest(step)


@pytest.mark.parametrize("code", ["ENOLCK", "ENOSYS", "EOPNOTSUPP", "EINVAL"])
def test_a_filesystem_without_locks_runs_unlocked_with_one_warning_naming_the_dir(tmp_path, monkeypatch, caplog, code):
    """Before: flock's OSError (no filename) escaped run_training as a raw traceback on NFSv3 without lockd,
    Lustre mounted noflock or a FUSE mount: no run could start there at all."""
    import errno
    import fcntl

    def no_locks(handle, how):
        raise OSError(getattr(errno, code), "no locks here")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="flexengine.core.storage"):
        with hold_output_dir(out, None):
            assert (out / RUN_LOCK).read_text().startswith("pid ")  # the holder is still written, for a reader
        with hold_output_dir(out, "auto"):  # the same directory again (a resume in one process): no second warning
            pass
    warned = [r.getMessage() for r in caplog.records if "no locks" in r.getMessage()]
    assert len(warned) == 1 and str(out) in warned[0] and "not prevented" in warned[0], warned


def test_any_other_lock_failure_still_raises(tmp_path, monkeypatch):
    import errno
    import fcntl

    def broken(handle, how):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(OSError, match="I/O error"), hold_output_dir(tmp_path / "out", None):
        pass


def test_write_json_atomic(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"a": 1, "p": tmp_path})  # non-JSON values are written as strings
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


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


def test_output_dir_holding_a_run_is_refused_unless_resumed(tmp_path):
    run = tmp_path / "out" / "checkpoints"  # two steps (the check reads the step directories' names)
    for step in (1, 2):
        (run / f"step_{step}").mkdir(parents=True)
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


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("")
    with pytest.raises(UserError, match=f"{tmp_path / 'out'} is a file, not a directory"):
        check_output_dir(tmp_path / "out", None)


def test_read_only_output_dir_is_one_paragraph_naming_the_path(tmp_path, monkeypatch):
    def read_only(path, mode="w"):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(storage, "open_output", read_only)  # root ignores chmod; a read-only mount is simulated
    with pytest.raises(UserError) as err:
        check_output_dir(tmp_path / "out", None)
    message = str(err.value)
    assert f"failed at {tmp_path / 'out'}/.write_test_" in message and "Read-only file system" in message
    assert "\n" not in message


def test_a_symlinked_lock_is_refused_and_its_target_stays_intact(tmp_path):
    """Before: open(.lock, "a+") followed the link, truncated its target and wrote `pid N on host H` into it."""
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("do not touch\n")
    (out / RUN_LOCK).symlink_to(target)
    with pytest.raises(UserError, match=rf"{out / RUN_LOCK} is a symbolic link.*remove it"), hold_output_dir(out, None):
        pass
    assert target.read_text() == "do not touch\n"


def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / RUN_LOCK)  # a FIFO would block the open, a device would be written to
    with pytest.raises(UserError, match=rf"{out / RUN_LOCK} is not a regular file"), hold_output_dir(out, None):
        pass


@pytest.mark.parametrize("mode", ["a", "w"])
def test_files_written_in_an_output_dir_follow_no_link(tmp_path, mode):
    target = tmp_path / "precious.txt"
    target.write_text("do not touch\n")
    (tmp_path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(UserError, match="is a symbolic link"):
        storage.open_output(tmp_path / "metrics.jsonl", mode)
    assert target.read_text() == "do not touch\n"
    with storage.open_output(tmp_path / "plain.txt", mode) as f:  # a plain file is written as open() would
        f.write("x\n")
    assert (tmp_path / "plain.txt").read_text() == "x\n"


def test_an_atomic_write_never_writes_through_a_planted_temp_link(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("do not touch\n")
    planted = tmp_path / f".summary.json.tmp_{socket.gethostname()}_{os.getpid()}"
    planted.symlink_to(target)
    (tmp_path / "summary.json").symlink_to(target)  # the final name: replaced as a name, never written through
    write_json_atomic(tmp_path / "summary.json", {"a": 1})
    assert target.read_text() == "do not touch\n"
    assert json.loads((tmp_path / "summary.json").read_text()) == {"a": 1}
    assert not (tmp_path / "summary.json").is_symlink()


def test_sizes_below_a_gib_are_shown_in_mib():
    assert storage.size_text(12 << 20) == "12 MiB" and storage.size_text(3 << 30) == "3.00 GiB"
    message = storage.disk_full_message(Path("/nowhere"), 10 << 20, 3 << 19)
    assert "needs 10 MiB, 1.5 MiB free" in message, message  # before: "needs 0.01 GiB, 0.00 free"


def test_the_write_probe_never_writes_through_a_planted_link(tmp_path):
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("do not touch\n")
    (out / f".write_test_{socket.gethostname()}_{os.getpid()}").symlink_to(target)
    check_output_dir(out, None)
    assert target.read_text() == "do not touch\n" and not list(out.iterdir())
