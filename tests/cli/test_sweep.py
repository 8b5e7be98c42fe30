"""Sweep summary: one row per job from summary.json / error.json, and a real multirun with a failing job."""

from __future__ import annotations

import csv
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from flexengine.cli.sweep import find_job_dirs, summarize_sweep, varying_overrides, write_job_error
from tests.helpers import hide_package

REPO = Path(__file__).resolve().parents[2]


def _job(sweep: Path, num: int, overrides: list[str]) -> Path:
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (d / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  job:\n    num: {num}\n")
    return d


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_rows_come_from_each_jobs_files(tmp_path):
    # jobs created out of order, with 10 > 2 to catch a string sort of job numbers
    ok = _job(tmp_path, 10, ["attn=packed_doc", "memory=none"])
    summary = {
        "tokens_per_s": 1000.0,
        "useful_tokens_per_s": 900.0,
        "mfu": 0.25,
        "peak_memory_bytes": 3 * 2**30,
        "final_loss": 2.5,
        "steps": 20,
        "wall_s": 12.0,
    }
    (ok / "summary.json").write_text(json.dumps(summary))
    failed = _job(tmp_path, 2, ["attn=causal", "memory=none"])
    try:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except RuntimeError as e:
        write_job_error(failed, e)
    _job(tmp_path, 3, ["attn=causal", "memory=full"])  # killed: neither file

    rows = summarize_sweep(tmp_path)
    assert [r["job"] for r in rows] == ["2", "3", "10"]
    assert [r["status"] for r in rows] == ["failed", "missing", "ok"]
    assert rows[0]["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    table = _read_csv(tmp_path / "sweep_summary.csv")
    assert len(table) == 3
    good = table[2]
    assert good["overrides"] == "attn=packed_doc memory=none"
    assert float(good["useful_tokens_per_s"]) == 900.0 and float(good["mfu"]) == 0.25
    assert float(good["peak_memory_gib"]) == 3.0 and float(good["final_loss"]) == 2.5
    assert table[0]["useful_tokens_per_s"] == "" and "out of memory" in table[0]["error"]
    md = (tmp_path / "sweep_summary.md").read_text()
    assert md.count("\n") == 2 + 3 and "out of memory" in md and "| missing |" in md
    assert (tmp_path / "sweep_summary.png").stat().st_size > 0


def test_error_json_keeps_the_traceback(tmp_path):
    try:
        {}["missing"]
    except KeyError as e:
        path = write_job_error(tmp_path / "job", e)
    record = json.loads(path.read_text())
    assert record["type"] == "KeyError" and "'missing'" in record["message"]
    assert "test_error_json_keeps_the_traceback" in record["traceback"]


def test_labels_keep_only_what_varies():
    rows = [
        {"job": "0", "overrides": "debug=fast attn=causal memory=none"},
        {"job": "1", "overrides": "debug=fast attn=packed_doc memory=none"},
    ]
    assert varying_overrides(rows) == ["attn=causal", "attn=packed_doc"]
    assert varying_overrides(rows[:1]) == ["debug=fast attn=causal memory=none"]


def test_no_jobs_writes_nothing(tmp_path):
    assert summarize_sweep(tmp_path) == [] and find_job_dirs(tmp_path) == []
    assert not (tmp_path / "sweep_summary.csv").exists()


def test_multirun_summarises_and_survives_a_failing_job(tmp_path):
    """micro_batch=100000 asks for more rows than the demo data has: that job fails, the sweep goes on."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexengine.train",
            "-m",
            "debug=fast",
            "train.max_steps=2",
            "train.save_final=false",
            "train.micro_batch=100000,2",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _read_csv(sweep / "sweep_summary.csv")
    assert [r["status"] for r in table] == ["failed", "ok"]
    assert "packed rows" in table[0]["error"] and (sweep / "0" / "error.json").is_file()
    summary = json.loads((sweep / "1" / "summary.json").read_text())
    assert float(table[1]["useful_tokens_per_s"]) == pytest.approx(summary["useful_tokens_per_s"])
    assert float(table[1]["final_loss"]) == pytest.approx(summary["final_loss"])
    assert table[1]["steps"] == "2"
    assert (sweep / "sweep_summary.md").is_file() and (sweep / "sweep_summary.png").is_file()
    # TensorBoard: the run is named by its overrides, shown once, and its HPARAMS row carries the schedule and friends
    run = sweep / "tb" / "train.micro_batch=2"
    assert run.is_dir() and not run.is_symlink() and not (sweep / "1" / "tb").exists()
    assert _tensorboard_runs(sweep) == ["tb/train.micro_batch=2"]
    hparams = _hparams(run)
    assert {"schedule", "warmup_steps", "weight_decay", "lora_r", "eval_fraction"} <= set(hparams)
    assert hparams["schedule"] == "cosine" and hparams["warmup_steps"] == 1 and hparams["lora_r"] == 0


def test_a_sweep_whose_every_job_failed_exits_1(tmp_path):
    """Both jobs set optim.warmup_steps and optim.warmup_ratio on the command line (refused inside each job, not at
    composition): the sweep runs both, summarises them, and exits 1 instead of 0."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexengine.train",
            "-m",
            "optim.warmup_steps=1",
            "optim.warmup_ratio=0.1,0.2",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert [r["status"] for r in _read_csv(sweep / "sweep_summary.csv")] == ["failed", "failed"]
    assert "every job of the sweep failed (2 of 2)" in proc.stdout + proc.stderr


def _tensorboard_runs(logdir: Path) -> list[str]:
    """The runs `tensorboard --logdir logdir` lists (it follows symlinks: a linked directory is a second run)."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    return sorted(EventMultiplexer().AddRunsFromDirectory(str(logdir)).Runs())


def _write_events(tb_dir: Path, loss: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(tb_dir)) as writer:
        writer.add_scalar("train/loss", loss, 1)


def _hparams(tb_dir: Path) -> dict:
    """The hparams TensorBoard's HPARAMS tab shows for the run in tb_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    ea = EventAccumulator(str(tb_dir))
    ea.Reload()
    content = ea.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: (v.string_value or v.number_value) for k, v in info.hparams.items()}


def test_table_has_eval_loss_and_tensorboard_runs_are_named_by_overrides(tmp_path):
    for num, lr in enumerate(("1e-3", "3e-3")):
        d = _job(tmp_path, num, ["debug=fast", f"optim.lr={lr}", "data.path=/d/x.jsonl"])
        _write_events(d / "tb", loss=3.0 + num)
        summary = {"final_loss": 3.0, "steps": 4, "eval": {"loss": 3.5 - num, "best_loss": 3.25 - num}}
        (d / "summary.json").write_text(json.dumps(summary))
    _job(tmp_path, 2, ["debug=fast", "optim.lr=1e-2", "data.path=/d/x.jsonl"])  # no tb/ (failed early)
    rows = summarize_sweep(tmp_path)
    table = _read_csv(tmp_path / "sweep_summary.csv")
    assert [float(r["eval_loss"]) for r in table[:2]] == [3.5, 2.5]
    assert [float(r["best_eval_loss"]) for r in table[:2]] == [3.25, 2.25] and table[2]["eval_loss"] == ""
    assert "eval_loss" in (tmp_path / "sweep_summary.md").read_text()
    # one TensorBoard run per job, named by the overrides that vary (was: 0/tb, 1/tb and a named link to each)
    assert _tensorboard_runs(tmp_path) == ["tb/optim.lr=1e-3", "tb/optim.lr=3e-3"]
    assert _tensorboard_runs(tmp_path / "tb") == ["optim.lr=1e-3", "optim.lr=3e-3"]
    assert not (tmp_path / "1" / "tb").exists()
    _write_events(tmp_path / "1" / "tb", loss=9.0)  # the job resumed into its own directory later
    assert summarize_sweep(tmp_path) == rows  # rebuilding merges the new events into the same run
    assert _tensorboard_runs(tmp_path) == ["tb/optim.lr=1e-3", "tb/optim.lr=3e-3"]
    assert len(list((tmp_path / "tb" / "optim.lr=3e-3").glob("events.out.tfevents.*"))) == 2


def test_a_sweep_summarised_with_links_before_gets_its_events_moved(tmp_path):
    for num, lr in enumerate(("1e-3", "3e-3")):
        d = _job(tmp_path, num, [f"optim.lr={lr}"])
        _write_events(d / "tb", loss=1.0)
        (d / "summary.json").write_text(json.dumps({"final_loss": 1.0}))
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "optim.lr=1e-3").symlink_to(Path("..") / "0" / "tb", target_is_directory=True)
    assert len(_tensorboard_runs(tmp_path)) == 3  # 0/tb, 1/tb and the link: job 0 shown twice
    rows = summarize_sweep(tmp_path)
    assert len(rows) == 2 and _tensorboard_runs(tmp_path) == ["tb/optim.lr=1e-3", "tb/optim.lr=3e-3"]


def test_jobs_whose_labels_make_one_name_keep_one_run_each(tmp_path):
    for num, path in enumerate(("/d/x", "_d_x")):  # a path separator cannot be part of a directory name
        d = _job(tmp_path, num, [f"data.path={path}"])
        _write_events(d / "tb", loss=float(num))
        (d / "summary.json").write_text(json.dumps({"final_loss": 1.0}))
    summarize_sweep(tmp_path)
    assert _tensorboard_runs(tmp_path) == ["tb/data.path=_d_x_job0", "tb/data.path=_d_x_job1"]


def test_plot_overlays_loss_curves_and_prints_bar_values(tmp_path):
    from flexengine.cli.sweep import job_row, write_plot

    rows = []
    for num, lr in enumerate(("1e-3", "3e-3")):
        d = _job(tmp_path, num, ["debug=fast", f"optim.lr={lr}"])
        summary = {
            "useful_tokens_per_s": 1234.0 * (num + 1),
            "peak_memory_bytes": (num + 1) * 2**30,
            "losses": [5.0, 4.0, 3.5, 3.0],
            "final_loss": 3.0,
            "steps": 4,
            "status": "ok",
            "eval": {"history": [{"step": 2, "loss": 4.2}, {"step": 4, "loss": 3.4}]},
        }
        (d / "summary.json").write_text(json.dumps(summary))
        rows.append(job_row(d, str(num)))
    fig = write_plot(rows, tmp_path / "p.png")
    loss_ax, speed_ax, memory_ax = fig.axes
    assert len(loss_ax.lines) == 4  # train + eval per job
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == ["optim.lr=1e-3", "optim.lr=3e-3"]
    assert [t.get_text().strip() for t in speed_ax.texts] == ["1,234", "2,468"]
    assert [t.get_text().strip() for t in memory_ax.texts] == ["1.00", "2.00"]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_without_matplotlib_the_sweep_keeps_its_table_and_names_the_extra(tmp_path, monkeypatch, caplog):
    hide_package(monkeypatch, "matplotlib")
    d = _job(tmp_path, 0, ["optim.lr=1e-3"])
    (d / "summary.json").write_text(json.dumps({"final_loss": 3.0, "steps": 4, "status": "ok", "losses": [3.0]}))
    with caplog.at_level(logging.WARNING, logger="flexengine.cli.sweep"):
        assert len(summarize_sweep(tmp_path)) == 1
    assert (tmp_path / "sweep_summary.csv").is_file() and not (tmp_path / "sweep_summary.png").exists()
    said = "sweep_summary.png needs the `matplotlib` package, which is not installed: pip install 'flexengine[plots]'"
    assert said in caplog.text


def test_interrupted_job_row_and_non_training_sweep(tmp_path):
    from flexengine.cli.sweep import job_row

    d = _job(tmp_path / "a", 0, ["x=1"])
    (d / "summary.json").write_text(json.dumps({"status": "interrupted", "steps": 3}))
    assert job_row(d, "0")["status"] == "interrupted"
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as e:
        write_job_error(_job(tmp_path / "a", 1, ["x=2"]), e)
    assert [r["status"] for r in summarize_sweep(tmp_path / "a")] == ["interrupted", "interrupted"]
    # jobs that are not training runs (no summary.json / error.json): no misleading summary
    for num in (0, 1):
        (_job(tmp_path / "b", num, [f"data.seq_len={num}"]) / "data_stats.json").write_text("{}")
    assert summarize_sweep(tmp_path / "b") == [] and not (tmp_path / "b" / "sweep_summary.csv").exists()


def test_stats_multirun_writes_no_training_summary(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flexengine.stats",
            "-m",
            "debug=fast",
            "data.num_workers=0",
            "data.seq_len=128,256",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(tmp_path.glob("*/data_stats.json"))) == 2
    assert not (tmp_path / "sweep_summary.csv").exists()


@pytest.mark.slow
def test_ctrl_c_stops_the_whole_multirun_and_marks_the_job_interrupted(tmp_path):
    import signal
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "flexengine.train",
            "-m",
            "debug=fast",
            "train.max_steps=200",
            "data.num_workers=0",
            "optim.lr=1e-3,2e-3",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 600
    for line in proc.stdout:  # wait until the first job is really training
        if "step 2/200" in line or time.time() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 130, out[-3000:]
    table = _read_csv(tmp_path / "sweep_summary.csv")
    assert [r["status"] for r in table] == ["interrupted"]  # the second job never started
    assert int(table[0]["steps"]) < 200
    assert not (tmp_path / "1").exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_exits_0(flag):
    """Before: `flexengine-sweep --help` printed the usage as an error and exited 2."""
    proc = subprocess.run([sys.executable, "-m", "flexengine.sweep", flag], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m flexengine.sweep <sweep_dir>"), proc
    wrong = subprocess.run([sys.executable, "-m", "flexengine.sweep"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "usage:" in wrong.stderr  # no directory given: still a usage error
