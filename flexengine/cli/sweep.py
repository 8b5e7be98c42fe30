"""One summary for a Hydra multirun: every job's summary.json (or error.json) as a row of a CSV/Markdown table
and a comparison plot in the sweep directory.

`SweepSummary` is a Hydra callback (registered under `hydra.callbacks` in conf/config.yaml), so
`python -m flexengine.train -m attn=causal,packed_doc memory=none,full` ends with sweep_summary.{csv,md,png}.
`python -m flexengine.sweep <sweep_dir>` rebuilds the summary of an existing (or interrupted) sweep.
When the sweep ends, each job's TensorBoard events move to `<sweep_dir>/tb/<overrides that vary between jobs>`, so
`tensorboard --logdir <sweep_dir>` shows one run per job (and its HPARAMS row) named by what was swept, not by job
number; while the sweep runs they are in each job's own tb/.
A failed job is a row with its error: train.py writes error.json (`write_job_error`) instead of ending the sweep;
a sweep whose every job failed exits 1.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from flexengine.cli.common import ERROR_FILE, write_job_error  # noqa: F401  (write_job_error: part of this module's API)
from flexengine.core.extras import require
from flexengine.core.units import GiB

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
TB_LINKS = "tb"  # <sweep_dir>/tb/<varying overrides>: each job's TensorBoard events, moved there at the end
# (column, summary.json key (dotted: nested), scale): the numbers each row reports.
METRICS = (
    ("tokens_per_s", "tokens_per_s", 1.0),
    ("useful_tokens_per_s", "useful_tokens_per_s", 1.0),
    ("mfu", "mfu", 1.0),
    ("peak_memory_gib", "peak_memory_bytes", 1 / GiB),
    ("final_loss", "final_loss", 1.0),
    ("eval_loss", "eval.loss", 1.0),  # the last evaluation's held-out loss
    ("best_eval_loss", "eval.best_loss", 1.0),
    ("steps", "steps", 1.0),
    ("wall_s", "wall_s", 1.0),  # the whole run, evaluations included
    ("train_s", "train_s", 1.0),  # training steps only
)
COLUMNS = ("job", "overrides", "status", *(m[0] for m in METRICS), "error", "dir")


def _read_yaml(path: Path) -> Any:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.is_file() else None


def find_job_dirs(sweep_dir: Path) -> list[Path]:
    """Job directories of a sweep (those holding Hydra's .hydra/overrides.yaml), in job-number order."""
    dirs = [p.parent.parent for p in sweep_dir.rglob("overrides.yaml") if p.parent.name == ".hydra"]

    def job_num(d: Path) -> tuple:
        hydra_cfg = _read_yaml(d / ".hydra" / "hydra.yaml") or {}
        num = hydra_cfg.get("hydra", {}).get("job", {}).get("num")
        return (num if isinstance(num, int) else sys.maxsize, str(d))

    return sorted(dirs, key=job_num)


def _lookup(summary: dict, key: str) -> Any:
    """summary[key], following dots into nested dicts ("eval.loss"); None where a level is missing."""
    value: Any = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def job_row(job_dir: Path, job: str) -> dict:
    """One table row: the job's overrides and numbers from summary.json, or its error from error.json."""
    overrides = _read_yaml(job_dir / ".hydra" / "overrides.yaml") or []
    row: dict = dict.fromkeys(COLUMNS)
    row.update(job=job, overrides=" ".join(overrides), dir=str(job_dir), error="")
    summary_path, error_path = job_dir / SUMMARY_FILE, job_dir / ERROR_FILE
    if error_path.is_file():
        error = json.loads(error_path.read_text())
        row["status"] = "interrupted" if error.get("type") == "KeyboardInterrupt" else "failed"
        row["error"] = f"{error.get('type', 'Error')}: {error.get('message', '')}".strip()
    elif summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        row["status"] = summary.get("status", "ok")  # "interrupted": stopped by Ctrl-C / SIGTERM mid-run
        for column, key, scale in METRICS:
            value = _lookup(summary, key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[column] = value * scale if scale != 1 else value  # integers (steps) stay integers
    else:  # killed, or still running
        row["status"] = "missing"
        row["error"] = f"no {SUMMARY_FILE} or {ERROR_FILE} in {job_dir}"
    return row


def varying_overrides(rows: list[dict]) -> list[str]:
    """Per row, only the overrides that differ between jobs (a short label for tables and plots)."""
    split = [r["overrides"].split() for r in rows]
    common = set.intersection(*map(set, split)) if len(split) > 1 else set()
    return [" ".join(o for o in s if o not in common) or f"job {r['job']}" for s, r in zip(split, rows)]


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_markdown(rows: list[dict], path: Path) -> None:
    """The table as Markdown, labelled by the overrides that vary between jobs."""
    columns = ["job", "run", "status", *(m[0] for m in METRICS), "error"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row, label in zip(rows, varying_overrides(rows)):
        cells = {**row, "run": label, "error": (row["error"] or "")[:200]}
        lines.append("| " + " | ".join(_fmt(cells[c]) for c in columns) + " |")
    path.write_text("\n".join(lines) + "\n")


def _curves(job_dir: Path) -> tuple[list[float], list[tuple[int, float]]]:
    """(train loss per step, [(step, eval loss)]) of one job, from its summary.json."""
    path = job_dir / SUMMARY_FILE
    if not path.is_file():
        return [], []
    summary = json.loads(path.read_text())
    evals = (summary.get("eval") or {}).get("history") or []
    return list(summary.get("losses") or []), [(e["step"], e["loss"]) for e in evals]


def write_plot(rows: list[dict], path: Path):
    """Loss curves of every job overlaid (train solid, eval dashed with markers), and bars of useful tokens/s and
    peak memory with their values; each job keeps one colour, labelled by the overrides that vary. Returns the
    (closed) matplotlib figure."""
    require("matplotlib", "the sweep's sweep_summary.png").use("Agg")
    import matplotlib.pyplot as plt

    labels = varying_overrides(rows)
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(rows))]
    fig = plt.figure(figsize=(15, 4.5 + 0.25 * len(rows)))
    grid = fig.add_gridspec(1, 3, width_ratios=[1.6, 1, 1])
    ax = fig.add_subplot(grid[0])
    for row, label, color in zip(rows, labels, colors):
        train, evals = _curves(Path(row["dir"]))
        if train:
            ax.plot(
                range(1, len(train) + 1),
                train,
                color=color,
                label=f"{label} ({row['status']})" if row["status"] != "ok" else label,
            )
        if evals:
            ax.plot(*zip(*evals), color=color, linestyle="--", marker="o", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (train solid, eval dashed)")
    ax.set_title("loss")
    if ax.lines:
        ax.legend(fontsize=8, loc="upper right")
    y = list(range(len(rows)))
    for slot, (key, title, fmt) in enumerate(
        (("useful_tokens_per_s", "useful tokens/s", "{:,.0f}"), ("peak_memory_gib", "peak memory (GiB)", "{:.2f}")),
        start=1,
    ):
        bar_ax = fig.add_subplot(grid[slot])
        values = [r[key] if r[key] is not None else 0.0 for r in rows]
        bars = bar_ax.barh(y, values, color=colors)
        for bar, r, v in zip(bars, rows, values):
            text = fmt.format(v) if r[key] is not None else r["status"].upper()
            bar_ax.text(
                bar.get_width(),
                bar.get_y() + bar.get_height() / 2,
                f" {text}",
                va="center",
                fontsize=8,
                color="black" if r[key] is not None else "tab:red",
            )
        bar_ax.set_yticks(y, labels, fontsize=8) if slot == 1 else bar_ax.set_yticks(y, [""] * len(rows))
        bar_ax.invert_yaxis()
        bar_ax.set_xlim(0, max(values + [1e-9]) * 1.3)  # room for the printed values
        bar_ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig  # closed, but still inspectable (tests read its lines, legend and printed values)


def _run_names(rows: list[dict]) -> list[str]:
    """Each job's TensorBoard run name: the overrides that vary; jobs sharing one get their job number added (the
    same rows give the same names, so rebuilding a summary finds the runs it made)."""
    # a directory name per label: no path separators, bounded length (varying_overrides never gives an empty one)
    names = [label.replace(os.sep, "_").replace(" ", ",")[:200] for label in varying_overrides(rows)]
    shared = {n for n in names if names.count(n) > 1}
    return [f"{n}_job{r['job'].replace(os.sep, '_')}" if n in shared else n for n, r in zip(names, rows)]


def _merge_into(source: Path, dest: Path) -> None:
    """Move source's files into dest (created if missing), subdirectories merged; a name dest already has stays
    where it was (event files carry host, pid and time in their names: a clash is not a run's data)."""
    if not dest.exists():
        source.rename(dest)
        return
    for entry in source.iterdir():
        target = dest / entry.name
        if entry.is_dir() and target.is_dir():
            _merge_into(entry, target)
        elif not target.exists():
            entry.rename(target)
    if not any(source.iterdir()):
        source.rmdir()


def gather_tensorboard_runs(rows: list[dict], sweep_dir: Path) -> Optional[Path]:
    """Move each job's tb/ to <sweep_dir>/tb/<overrides that vary>: TensorBoard names a run by its directory, and
    a run reachable by two paths (the job's own tb/ and a named link to it, as before) is shown twice. With the
    events in one place, `tensorboard --logdir` the sweep directory (or its tb/) shows one run per job, named by
    what was swept. Returns the directory (None: no job wrote TensorBoard events)."""
    root = sweep_dir / TB_LINKS
    for row, name in zip(rows, _run_names(rows)):
        events = Path(row["dir"]) / "tb"
        if events.is_symlink() or not events.is_dir():
            continue
        root.mkdir(exist_ok=True)
        dest = root / name
        if dest.is_symlink():  # a sweep summarised before: its link to the job's tb/ gives way to the events
            dest.unlink()
        _merge_into(events, dest)
    return root if root.is_dir() and any(root.iterdir()) else None


def summarize_sweep(sweep_dir: Path) -> list[dict]:
    """Write sweep_summary.csv/.md/.png into sweep_dir; returns the rows."""
    sweep_dir = Path(sweep_dir)
    rows = [job_row(d, str(d.relative_to(sweep_dir))) for d in find_job_dirs(sweep_dir)]  # job = its subdir
    if not rows:
        log.warning("sweep summary: no job directories (.hydra/overrides.yaml) under %s", sweep_dir)
        return rows
    if all(r["status"] == "missing" for r in rows):  # e.g. `data.stats -m`: not training jobs at all
        log.info(
            "sweep summary: no job under %s wrote %s or %s (not a training sweep); nothing summarised",
            sweep_dir,
            SUMMARY_FILE,
            ERROR_FILE,
        )
        return []
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(rows, sweep_dir / "sweep_summary.md")
    try:
        write_plot(rows, sweep_dir / "sweep_summary.png")
    except Exception as e:  # a missing font/backend must not cost the user the table
        log.warning("sweep summary: could not draw sweep_summary.png (%s)", e)
    failed = sum(r["status"] != "ok" for r in rows)
    log.info("sweep summary: %d runs (%d not ok) -> %s", len(rows), failed, sweep_dir / "sweep_summary.md")
    tb = gather_tensorboard_runs(rows, sweep_dir)
    if tb is not None:
        log.info("sweep summary: tensorboard --logdir %s (one run per job, named by its overrides)", tb)
    return rows


def reset_peak_memory() -> None:
    """Start a job's peak-memory count from now: jobs of a sweep share one process, and both CUDA's
    max_memory_allocated and the process's peak RSS (ru_maxrss) would otherwise carry the earlier jobs' peaks."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # Linux: writing 5 to clear_refs resets the RSS high-water mark that ru_maxrss reports
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class SweepSummary(Callback):
    """Hydra callback: after a multirun, summarise every job into the sweep directory."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Each job of a sweep reports its own peak memory, not the largest so far."""
        reset_peak_memory()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write sweep_summary.{csv,md,png} (Hydra warns, but does not fail, if this raises)."""
        rows = summarize_sweep(Path(config.hydra.sweep.dir))
        if rows:
            print((Path(config.hydra.sweep.dir) / "sweep_summary.md").read_text())
        if rows and all(r["status"] == "failed" for r in rows):
            # a job's failure is a row (the sweep goes on), but a sweep of nothing but failures is not a success
            # for the script or scheduler that launched it; SystemExit passes Hydra's callback guard
            log.error("every job of the sweep failed (%d of %d): see the error column above", len(rows), len(rows))
            sys.exit(1)


SWEEP_USAGE = "usage: python -m flexengine.sweep <sweep_dir>   (e.g. multirun/2026-01-01/12-00-00)"
SWEEP_HELP = (
    "(Re)build sweep_summary.{csv,md,png} of a sweep directory from its jobs' summary.json / error.json and print "
    "the table. A sweep itself runs with `python -m flexengine.train -m key=a,b`, which writes the summary at its end."
)


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m flexengine.sweep <sweep_dir>`: (re)build the summary of a sweep directory."""
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):  # asked for: the usage on stdout, success
        print(f"{SWEEP_USAGE}\n{SWEEP_HELP}")
        return
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(SWEEP_USAGE, file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if summarize_sweep(Path(argv[0])):
        print((Path(argv[0]) / "sweep_summary.md").read_text())


if __name__ == "__main__":
    main()
