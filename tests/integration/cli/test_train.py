"""End-to-end: the entry point, HF round trip of checkpoints, exact resume, loss normalisation, bad input."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexengine.run import build_trainer, run_training
from tests.helpers import make_job

REPO = Path(__file__).resolve().parents[3]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flexengine.train", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_default_entry_point_runs_and_writes_everything(tmp_path):
    proc = run_cli("debug=fast", "train.max_steps=6", "train.save_every=3", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "steps",
        "tokens_seen",
        "useful_tokens_seen",
        "tokens_per_s",
        "useful_tokens_per_s",
        "initial_loss",
        "final_loss",
        "losses",
        "peak_memory_bytes",
        "wall_s",
        "config",
        "block_density",
    ):
        assert key in summary, key
    assert summary["steps"] == 6 and len(summary["losses"]) == 6
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["attention"]["backend"] == "varlen" and summary["attention"]["mode"] == "packed_doc"
    assert summary["config"]["attn"]["mode"] == "packed_doc"
    assert 0 < summary["useful_tokens_seen"] <= summary["tokens_seen"]
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3", "step_6"]


def test_checkpoint_is_a_standard_hf_directory_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = build_trainer(make_job(tmp_path, "train.max_steps=2"), tmp_path)
    trainer.train()
    path = tmp_path / "checkpoints" / "step_2"
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tokenizer("def f(x):\n    return x + 1\n")["input_ids"]])
    ours = trainer.model.eval()
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
        want = hf(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- bad input: one paragraph, no traceback, non-zero exit, before heavy work -----------------------------


def _bad_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a fine document"}\n{"text": "another"}\n{"text": broken\n')
    return path


BAD_INPUTS = {
    "missing_model_path": (["model=deepseek7b"], "model.path"),
    "model_path_not_a_dir": (["model=deepseek7b", "model.path=/nonexistent/model"], "is not a directory"),
    "dir_without_config": (["model=deepseek7b", "model.path={tmp}"], "no config.json"),
    "unknown_model_family": (["model.arch.model_type=notamodel"], "model_type='notamodel'"),
    "malformed_jsonl": (["data=jsonl", "data.path={jsonl}"], "train.jsonl:3"),
    "empty_dataset": (["data=jsonl", "data.path={empty}"], "no usable documents"),
    "seq_len_not_positive": (["data.seq_len=0"], "data.seq_len=0"),
    "unknown_override_key": (["train.max_stpes=3"], "max_stpes"),
    "wrong_type": (["train.max_steps=many"], "max_steps"),
    "micro_batch_larger_than_data": (["debug=fast", "train.micro_batch=400", "memory=none"], "micro_batch=400"),
    "flex_cannot_train_on_cpu": (["debug=fast", "attn.backend=flex"], "attn.backend=flex"),
    "sliding_window_without_window": (["debug=fast", "attn=sliding_window", "attn.window=null"], "needs a window"),
    "output_dir_is_a_file": (["debug=fast", "train.output_dir={empty}"], "is a file, not a directory"),
    "malformed_model_config_json": (["model=deepseek7b", "model.path={badmodel}"], "config.json is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_with_a_clear_message(tmp_path, case):
    args, expected = BAD_INPUTS[case]
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "badmodel").mkdir()
    (tmp_path / "badmodel" / "config.json").write_text('{"model_type": "llama", ')
    subs = {
        "tmp": str(tmp_path),
        "jsonl": str(_bad_jsonl(tmp_path)),
        "empty": str(tmp_path / "empty.jsonl"),
        "badmodel": str(tmp_path / "badmodel"),
    }
    proc = run_cli(*[a.format(**subs) for a in args], f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_run_prints_flexengine_lines_and_one_plan_line(tmp_path):
    """Before: torch _pytree warnings, HF's 'Writing model shards' bars and a 31-row plan table at every run."""
    out = tmp_path / "run"
    proc = run_cli("debug=fast", "train.max_steps=1", "train.progress=false", f"train.output_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout + proc.stderr
    for noise in ("_pytree", "Writing model shards", "Failed to load", "it/s]"):
        assert noise not in printed, noise
    # the done line compares the measured step with the planned one: it is not a plan line
    plan_lines = [line for line in printed.splitlines() if "plan" in line.lower() and "- done:" not in line]
    assert len(plan_lines) == 1 and "<- chosen" not in printed, plan_lines
    assert "runners-up:" in plan_lines[0] and "full table: flexengine-plan" in plan_lines[0]
    assert next(line for line in printed.splitlines() if line.strip()).startswith("[")  # a flexengine line first


def _nan_update(trainer, on_step: int, what: str) -> None:
    """Make the optimizer update of step `on_step` write NaN into one weight (or one optimizer state), the way
    optim.weight_decay=nan did before it was refused at composition."""
    step = trainer.optimizer.step

    def nan_step(*args, **kwargs):
        step(*args, **kwargs)
        if trainer.state.step + 1 == on_step:
            param = next(p for p in trainer.model.parameters() if p.requires_grad)
            target = param if what == "weight" else trainer.optimizer.state[param]["exp_avg_sq"]
            with torch.no_grad():
                target.view(-1)[0] = float("nan")

    trainer.optimizer.step = nan_step


@pytest.mark.parametrize("what", ["weight", "optimizer state"])
def test_nonfinite_weights_are_never_saved(tmp_path, what):
    """Before: step_1 was written with NaN weights (99.9 % NaN after optim.weight_decay=nan), and the error at the
    next step blamed the lr."""
    from flexengine.core.errors import UserError

    trainer = build_trainer(
        make_job(tmp_path, "train.max_steps=3", "train.grad_accum=1", "train.save_every=1", "optim.grad_clip=0"),
        tmp_path,
    )
    _nan_update(trainer, 2, what)
    name = next(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    shown = name if what == "weight" else f"optimizer exp_avg_sq of {name}"
    with pytest.raises(UserError, match=rf"step 2: 1 tensor\(s\) hold NaN/Inf \({shown}\).*optim.grad_clip=0"):
        trainer.train()
    assert (tmp_path / "checkpoints" / "step_1").is_dir() and not (tmp_path / "checkpoints" / "step_2").exists()
    assert json.loads((tmp_path / "checkpoints" / "step_1" / "manifest.json").read_text())["finite"] is True


def test_resume_auto_never_reloads_a_nonfinite_step(tmp_path):
    """A NaN checkpoint written before the save-time check (no `finite` in its manifest) is moved aside and the
    newest finite step resumes; an explicit train.resume of it is refused."""
    from flexengine.core.errors import UserError
    from flexengine.loop.checkpoint.save import save_checkpoint

    run_training(make_job(tmp_path, "train.max_steps=2", "train.save_every=1"), tmp_path)
    trainer = build_trainer(make_job(tmp_path, "train.max_steps=3"), tmp_path)
    trainer.resume("auto")
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("inf")
    trainer.state.step = 3
    save_checkpoint(tmp_path / "checkpoints", 3, trainer.model, trainer.tokenizer, trainer.trainer_state())
    with pytest.raises(UserError, match="its weights hold NaN/Inf"):
        build_trainer(make_job(tmp_path, "train.max_steps=3"), tmp_path).resume(
            str(tmp_path / "checkpoints" / "step_3")
        )
    summary = run_training(make_job(tmp_path, "train.max_steps=3", "train.resume=auto"), tmp_path)
    assert summary["steps"] == 3 and math.isfinite(summary["final_loss"])
    assert (tmp_path / "checkpoints" / "step_3.nonfinite").is_dir()
    assert json.loads((tmp_path / "checkpoints" / "step_3" / "manifest.json").read_text())["finite"] is True


def test_sigterm_finishes_the_step_saves_and_stops(tmp_path):
    import os
    import signal

    trainer = build_trainer(make_job(tmp_path, "train.max_steps=5", "train.save_final=false"), tmp_path)
    real_step = trainer.train_step

    def step_then_signal():
        out = real_step()
        if trainer.state.step == 1:  # during the second step
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.train_step = step_then_signal
    summary = trainer.train()
    assert summary["steps"] == 2 and summary["stopped_by_signal"] == signal.SIGTERM
    assert (tmp_path / "checkpoints" / "step_2" / "trainer_state.pt").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored after training


# --- trust: runs never mixed, signals end in a save + summary + 128+signal, data faults refused -----------------


def _files(root: Path) -> dict:
    """Every run file with its mtime; `.lock` is left out: a refused run takes the lock (and writes its pid there)
    before it can look at the directory, which is what makes the check race-free."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in files}


def test_a_new_run_never_touches_an_existing_run(tmp_path):
    from flexengine.core.errors import UserError

    run_training(make_job(tmp_path, "train.max_steps=1"), tmp_path)
    before = _files(tmp_path)
    with pytest.raises(UserError, match="already holds a run .*train.resume=auto"):
        run_training(make_job(tmp_path, "train.max_steps=2"), tmp_path)
    assert _files(tmp_path) == before  # no checkpoint, summary or TensorBoard file rewritten or added


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_second_signal_during_the_save_does_not_kill_it(tmp_path, monkeypatch, sig):
    import os
    import signal

    from flexengine.loop import checkpointer
    from flexengine.loop import trainer as trainer_module
    from flexengine.loop.checkpoint.load import verify_checkpoint

    signum = getattr(signal, sig)
    real_step, real_save = trainer_module.Trainer.train_step, checkpointer.save_checkpoint

    def step_then_signal(self):
        out = real_step(self)
        if self.state.step == 1:  # during the second step
            os.kill(os.getpid(), signum)
        return out

    def signal_again_while_saving(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", step_then_signal)
    monkeypatch.setattr(checkpointer, "save_checkpoint", signal_again_while_saving)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    summary = run_training(make_job(tmp_path, "train.max_steps=5", "train.save_final=false"), tmp_path)
    assert summary["steps"] == 2 and summary["exit_code"] == 128 + signum
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_2") is None
    assert json.loads((tmp_path / "summary.json").read_text())["exit_code"] == 128 + signum
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # restored at the end


def test_a_third_signal_gives_up_the_save(tmp_path, monkeypatch):
    """Before: after the first signal every later Ctrl-C was swallowed until the end of the run."""
    import os
    import signal

    from flexengine.loop import checkpointer
    from flexengine.loop import trainer as trainer_module

    real_step, real_save = trainer_module.Trainer.train_step, checkpointer.save_checkpoint

    def step_then_signal(self):
        out = real_step(self)
        if self.state.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    def two_more_while_saving(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # "still saving"
        os.kill(os.getpid(), signal.SIGINT)  # gives up: Python's own SIGINT handler raises KeyboardInterrupt
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", step_then_signal)
    monkeypatch.setattr(checkpointer, "save_checkpoint", two_more_while_saving)
    # Python's own Ctrl-C handler, which the third signal hands over to: a process started in the background by a
    # non-interactive shell (`.ci/run &`) inherits SIGINT ignored, and then the third signal rightly stays ignored
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_training(make_job(tmp_path, "train.max_steps=5", "train.save_final=false"), tmp_path)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert not (tmp_path / "checkpoints" / "step_2").exists()


def test_a_signal_after_the_last_step_leaves_a_complete_run(tmp_path, monkeypatch, caplog):
    """Before: a SIGTERM during the final save of a run that had done all its steps reported status
    "interrupted" and exit 143, so a scheduler would requeue a finished job."""
    import os
    import signal

    from flexengine.loop import checkpointer

    real_save = checkpointer.save_checkpoint

    def signal_during_the_final_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "save_checkpoint", signal_during_the_final_save)
    caplog.set_level(logging.WARNING, logger="flexengine.loop.signals")
    summary = run_training(make_job(tmp_path, "train.max_steps=2"), tmp_path)
    assert summary["steps"] == 2 and summary["status"] == "ok" and summary["exit_code"] == 0
    assert (tmp_path / "checkpoints" / "step_2" / "manifest.json").is_file()
    # the message says what the exit status is (before: "finishing step 3, then ... exiting with status 143")
    assert "finishing the final save (step 2)" in caplog.text and "status 0" in caplog.text
    assert "143" not in caplog.text and "step 3" not in caplog.text


def test_a_signal_during_a_periodic_save_names_that_save_and_stops_after_it(tmp_path, monkeypatch, caplog):
    """Before: a SIGTERM while step 3's checkpoint was written said "finishing step 4", a step that never ran."""
    import os
    import signal

    from flexengine.loop import checkpointer

    real_save = checkpointer.save_checkpoint

    def signal_during_the_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "save_checkpoint", signal_during_the_save)
    caplog.set_level(logging.WARNING, logger="flexengine.loop.signals")
    summary = run_training(make_job(tmp_path, "train.max_steps=6", "train.save_every=3"), tmp_path)
    assert summary["steps"] == 3 and summary["exit_code"] == 143 and summary["status"] == "interrupted"
    assert "signal 15: finishing the checkpoint save of step 3, then exiting with status 143" in caplog.text
    assert "step 4" not in caplog.text


@pytest.mark.parametrize(
    "error, raised",
    [
        (TimeoutError("timed out"), TimeoutError),
        (FileNotFoundError(2, "No such file or directory", "/x/y"), "UserError"),
    ],
)
def test_only_os_errors_with_a_path_become_a_path_message(tmp_path, monkeypatch, error, raised):
    """Before: every OSError, a timeout or a lost connection too, became "check the path and the disk"."""
    from flexengine import run as run_module
    from flexengine.core.errors import UserError

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(run_module, "build_planned_trainer", fail)
    with pytest.raises(UserError if raised == "UserError" else raised) as err:
        run_training(make_job(tmp_path, "train.max_steps=1"), tmp_path)
    if raised == "UserError":
        assert "the run failed at /x/y: No such file or directory" in str(err.value)


_SIGNAL_RUN = """
import os, signal, sys
from flexengine.loop import trainer
real = trainer.Trainer.train_step
def step(self):
    out = real(self)
    if self.state.step == 1:
        os.kill(os.getpid(), signal.SIGINT)
    return out
trainer.Trainer.train_step = step
from flexengine.cli.train import main
sys.argv = ["train", *sys.argv[1:]]
main()
"""


def test_signal_stopped_run_exits_128_plus_signal_without_traceback(tmp_path):
    # a preemptible job sets resume=auto from its first launch; hydra.run.dir pins its directory (before: refused,
    # "resume=auto without train.output_dir")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _SIGNAL_RUN,
            "debug=fast",
            "train.max_steps=5",
            "train.resume=auto",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "checkpoints" / "step_2" / "manifest.json").is_file()


_CTRL_C_WHILE_PREPARING = """
import sys
from flexengine import run
def tokenizing(*args, **kwargs):
    raise KeyboardInterrupt
run.build_planned_trainer = tokenizing
from flexengine.cli.train import main
sys.argv = ["train", *sys.argv[1:]]
main()
"""


def test_ctrl_c_while_preparing_the_run_exits_130_without_traceback(tmp_path):
    """Before: Ctrl-C during tokenization or the model build (before the trainer's handlers exist) printed a
    KeyboardInterrupt traceback."""
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_PREPARING, "debug=fast", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr  # Hydra's job log goes to stdout
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "interrupted by SIGINT outside the training loop" in out


def test_zero_target_tokens_are_refused_before_training(tmp_path):
    from flexengine.core.errors import UserError

    with pytest.raises(UserError, match="no packed row has a token to predict"):
        build_trainer(make_job(tmp_path, "data.seq_len=1"), tmp_path)


def test_a_real_zero_loss_is_reported_as_zero():
    from flexengine.run import _fmt_loss

    assert _fmt_loss(0.0) == "0.0000" and _fmt_loss(None) == "n/a"


def _same_shape_corpora(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(40)))
    b.write_text("".join(json.dumps({"text": f"def g{i}(y):\n    return y + {i}\n"}) + "\n" for i in range(40)))
    return a, b


def test_resume_on_another_data_stream_is_refused_listing_what_changed(tmp_path):
    from flexengine.core.errors import UserError

    a, b = _same_shape_corpora(tmp_path)
    data = ["data=jsonl", "data.seq_len=64", "train.max_steps=4"]
    first = build_trainer(make_job(tmp_path, *data, f"data.path={a}", "train.max_steps=2"), tmp_path)
    first.train()
    other = build_trainer(make_job(tmp_path, *data, f"data.path={b}"), tmp_path)
    assert len(other.loader.plan.rows) == len(first.loader.plan.rows)  # the old check (row count) saw no change
    with pytest.raises(UserError, match="changed: corpus_sha256: '[0-9a-f]+' -> '[0-9a-f]+'.*resume_new_data"):
        other.resume("auto")
    longer = build_trainer(
        make_job(tmp_path, *data, f"data.path={a}", "data.seq_len=128", "train.micro_batch=1"), tmp_path
    )
    with pytest.raises(UserError, match="data.seq_len: 64 -> 128; train.micro_batch: 2 -> 1"):
        longer.resume("auto")
    # the same corpus, other training rows: before, only the corpus and config keys were compared
    held_out = build_trainer(make_job(tmp_path, *data, f"data.path={a}", "data.eval_fraction=0.25"), tmp_path)
    with pytest.raises(UserError, match="data.eval_fraction: 0.0 -> 0.25; rows_sha256: '[0-9a-f]+' -> '[0-9a-f]+'"):
        held_out.resume("auto")
    allowed = build_trainer(make_job(tmp_path, *data, f"data.path={b}", "train.resume_new_data=true"), tmp_path)
    allowed.resume("auto")
    assert allowed.state.step == 2 and allowed.loader.cursor == 0  # weights and step kept, new data from row 0


def _run_as_rank_1(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A one-step run as a torchrun rank 1 would start it: RANK=1 without WORLD_SIZE is one process (no process
    group) through the same entry point and Hydra overrides as a worker; it must succeed."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_RANK")}
    args = ["debug=fast", "train.max_steps=1", "train.progress=false", *overrides]
    proc = subprocess.run(
        [sys.executable, "-m", "flexengine.train", *args],
        cwd=cwd,
        env={**env, "RANK": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_torchrun_rank_above_0_writes_no_hydra_folder_log_or_config(tmp_path):
    """Before: each rank resolved ${now:...} itself, so a rank > 0 starting in another second made its
    own <date>/<time>/ with .hydra/ and a train.log. RANK=1 without WORLD_SIZE runs one process (no process group)
    through the same entry point and Hydra overrides as a torchrun worker."""
    out = tmp_path / "out"
    proc = _run_as_rank_1(tmp_path, f"train.output_dir={out}")
    assert "step 1/1" in proc.stdout  # its lines still reach the console
    assert not list(out.rglob(".hydra")) and not list(out.rglob("*.log")), sorted(map(str, out.rglob("*")))
    assert {p.name for p in out.iterdir() if p.is_dir()} <= {"checkpoints", "tb"}  # no <date>/<time>/
    assert not (tmp_path / "outputs").exists()


def test_worker_overrides_keep_a_typed_run_dir(monkeypatch):
    from flexengine.cli.train import worker_overrides

    monkeypatch.setenv("RANK", "0")
    assert worker_overrides([]) == []  # rank 0 (and a plain run) keeps Hydra's folder, config and log
    monkeypatch.setenv("RANK", "3")
    assert "hydra.output_subdir=null" in worker_overrides([])
    assert not any(o.startswith("hydra.run.dir=") for o in worker_overrides(["hydra.run.dir=/pinned"]))
    assert worker_overrides(["hydra/job_logging=disabled", "hydra.run.dir=/pinned"]) == ["hydra.output_subdir=null"]


def test_a_launch_without_an_output_dir_writes_under_outputs_not_none(tmp_path):
    """train.output_dir defaults to null: Hydra's run dir must then be outputs/<date>/<time>/ (oc.select's default
    covers a missing key only, so the null made ./None/<date>/<time>/ for the README's default command). A config
    error is the quickest launch that still makes the folder (its error.json)."""
    proc = run_cli("attn.mode=nope", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert not (tmp_path / "None").exists()
    assert [p.name for p in tmp_path.glob("outputs/*/*/error.json")] == ["error.json"]


def test_a_torchrun_worker_without_an_output_dir_does_not_check_the_output_root(tmp_path):
    """A rank > 0 without train.output_dir has the output root (outputs/) as its Hydra dir; an earlier run's
    summary.json there made it refuse a launch whose rank 0 writes to a fresh outputs/<date>/<time>/. Only rank 0
    checks (and locks) the run's directory."""
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "summary.json").write_text("{}")
    _run_as_rank_1(tmp_path, "train.save_final=false")


def test_launches_in_the_same_second_get_a_folder_each(tmp_path):
    """Before: both resolved ${now:%H-%M-%S} to the same <date>/<time>/ and shared one .hydra/ and train.log. A
    config error is the quickest launch that still makes its folder (its error.json)."""
    args = [sys.executable, "-m", "flexengine.train", "attn.mode=nope", f"train.output_dir={tmp_path / 'out'}"]
    procs = [subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    for proc in procs:
        proc.communicate(timeout=600)
        assert proc.returncode == 2
    folders = sorted(p.parent for p in (tmp_path / "out").glob("*/*/error.json"))
    # folders sort by time, pids by number: the two orders need not agree when the later pid starts first
    assert sorted(f.name.rsplit("-", 1)[1] for f in folders) == sorted(str(p.pid) for p in procs), folders


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (a tmpfs mounted ro: permissions do not stop root); skipped where mounting is not
    allowed."""
    mount = tmp_path / "ro"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_read_only_output_dir_is_one_paragraph_and_exit_2(read_only_dir, tmp_path):
    """Before: Hydra made <dir>/<date>/<time>/ before flexengine's own check, and died in a 60-line traceback, rc 1."""
    proc = run_cli("debug=fast", f"train.output_dir={read_only_dir / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"failed at {read_only_dir / 'run'}: Read-only file system" in proc.stderr


@pytest.mark.parametrize(
    "override, said",
    [
        ("model.path={tmp}/absent", "is not a directory"),
        ("data.path={tmp}/absent.jsonl", "matches no jsonl file"),
        ("model.path={tmp}/damaged", "model.safetensors"),
    ],
)
def test_missing_paths_and_damaged_model_files_stop_before_torch_is_imported(tmp_path, override, said):
    """Before: a wrong model.path or data.path was found only after torch and transformers were imported (12-40 s
    on a loaded machine). Now exit 2 with the message, and neither was imported."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text('{"model_type": "llama"}')
    (damaged / "model.safetensors").write_bytes(b"\x10\x00")  # cut short inside the header length
    argv = ["flexengine-train", "data=jsonl", override.format(tmp=tmp_path), f"hydra.run.dir={tmp_path}/run"]
    if "data.path" not in override:
        argv.append(f"data.path={Path(__file__)}")  # any existing file: the model check comes first
    code = (
        "import sys\nfrom flexengine.cli.train import main\n"
        f"sys.argv = {argv!r}\n"
        "try:\n    main()\nexcept SystemExit as e:\n"
        "    print('exit', e.code, 'torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert said in proc.stderr and "exit 2 False False" in proc.stderr, proc.stderr[-3000:]
