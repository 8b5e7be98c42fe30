"""The planner's step time against measured steps, the way bench/planner_vs_memtracker.py checks its bytes.

Real training steps on CPU (`build_trainer` + `train_step`, the run's own path) of a 30-block LLaMA (DeepSeek-7B's
depth) at reduced width, over a grid: memory policies (none, full, op-level SAC at a few k, every-2nd block, full
with a tiled MLP), row lengths, micro-batches, precision modes CPU runs, attention backends and packed documents of
several length mixes. Each point's planned step (the planner, priced with this machine's speed measured in this
process right before the grid: core/device_speed) is compared with the median of its measured steps after one
warm-up step (both in this process's CPU seconds: the machine is shared, and wall time would count the others'
load), and term by term where the planner has terms:
- optimizer: the measured optimizer phase (AdamW; the gradient norm runs outside it, in "other") vs the planned
  optimizer step;
- compute: the measured forward + backward phases vs matmul + attention + pointwise + loss + recompute;
- recompute: a policy's measured step less policy none's at the same shape, vs its planned recompute term;
- attention: a row of 2S tokens less two rows of S (the linear terms cancel), measured vs planned.

Targets: median |error| <= 20 %, Spearman rank correlation >= 0.9 across the grid, and in >= 90 % of the choice
sets (points the planner chooses between) its fastest within 5 % of the measured fastest.

    OMP_NUM_THREADS=1 .venv/bin/python bench/planner_time.py            # the grid, ~15 min on 2 loaded cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/planner_time.py --quick    # three points
Writes bench/results/planner_time.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# DeepSeek-7B's 30 blocks at a width CPU steps in about a second (its 4,096 hidden / 11,008 MLP / 32 heads shrunk)
MODEL = [
    "model.arch.num_hidden_layers=30",
    "model.arch.hidden_size=128",
    "model.arch.intermediate_size=344",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=4",
]
BASE = [*MODEL, "data.seq_len=512", "train.micro_batch=1", "train.grad_accum=1", "precision=fp32", "memory=none"]
ROUNDS = 3  # the grid measured this many times, interleaved; a point's figures are the rounds' medians
STEPS = 5  # measured steps per point, after WARMUP: the median of 5 (3 left ~15 % between two runs of one point)
WARMUP = 1


@dataclass(frozen=True)
class Point:
    """One grid point: its name, the choice sets it belongs to, and its overrides over BASE.

    A choice set is a set of points the planner chooses between by its seconds on this CPU, compared per token:
    memory=auto's policies, the micro-batch search, data.seq_len=auto's row lengths. The rest are measured for the
    error and the rank targets only: attn.backend=auto is a rule (varlen on CPU, flex on CUDA), precision=auto ranks
    modes by time on CUDA only (planning/fit.py; on CPU the most exact mode that fits), and the documents are the
    user's data."""

    name: str
    choices: tuple[str, ...]
    overrides: tuple[str, ...] = ()


GRID = [
    Point("none S=512", ("policy", "row length")),
    Point("full", ("policy",), ("memory=full",)),
    Point("full every_2", ("policy",), ("memory=full", "memory.layers=every_2")),
    Point("ops k=30", ("policy",), ("memory=selective", "memory.granularity=ops")),
    Point("ops k=10", ("policy",), ("memory=selective", "memory.granularity=ops", "memory.layers=spread_10")),
    Point("full + tiled MLP", ("policy",), ("memory=full", "memory.tiled_mlp=128")),
    Point("S=256", ("row length",), ("data.seq_len=256",)),
    Point("S=1024", ("row length",), ("data.seq_len=1024",)),
    Point("S=1024 full", (), ("data.seq_len=1024", "memory=full")),
    Point("mb=2 ga=1", ("micro-batch",), ("train.micro_batch=2",)),
    Point("mb=1 ga=2", ("micro-batch",), ("train.grad_accum=2",)),
    Point("mb=2 ga=1 full", ("micro-batch full",), ("train.micro_batch=2", "memory=full")),
    Point("mb=1 ga=2 full", ("micro-batch full",), ("train.grad_accum=2", "memory=full")),
    Point("varlen", (), ("attn.backend=varlen",)),
    Point("dense", (), ("attn.backend=dense",)),
    Point("bf16_mixed S=256", (), ("data.seq_len=256", "precision=bf16_mixed")),
    Point("short docs", (), ("data.source=jsonl", "data.path={short}")),
    Point("mixed docs", (), ("data.source=jsonl", "data.path={mixed}")),
]
QUICK = ("none S=512", "full", "S=1024")


def write_corpora(root: Path) -> dict[str, str]:
    """Two jsonl corpora of stdlib text: short documents (~300 characters) and a mix of 100-6,000 characters."""
    import random

    text = "".join(p.read_text(errors="ignore") for p in sorted(Path(json.__file__).parent.glob("*.py")))
    rng = random.Random(0)
    paths = {}
    for name, lengths in {"short": lambda: 300, "mixed": lambda: rng.randint(100, 6000)}.items():
        path = root / f"{name}.jsonl"
        with path.open("w") as f:
            at = 0
            for _ in range(400):
                n = lengths()
                f.write(json.dumps({"text": text[at : at + n]}) + "\n")
                at = (at + n) % (len(text) - 6000)
        paths[name] = str(path)
    return paths


def measure(point: Point, corpora: dict[str, str], out: Path) -> dict:
    """Build the point's run as training does, step it, and set its plan beside the measured steps."""
    from flexengine.cli.common import compose_job
    from flexengine.cli.doctor import DoctorHooks
    from flexengine.run import build_planned_trainer, planned_step

    overrides = [*BASE, *(o.format(**corpora) for o in point.overrides), f"train.output_dir={out}"]
    job = compose_job(overrides)
    job.train.progress = False
    trainer, run = build_planned_trainer(job, out)
    hooks = DoctorHooks()
    trainer.add_hooks(hooks)
    trainer.model.train()
    cpu_s = []
    for _ in range(WARMUP + STEPS):
        t0 = time.process_time()
        trainer.train_step()
        cpu_s.append(time.process_time() - t0)
    trainer.metrics.close()
    steps, cpu_s = hooks.steps[WARMUP:], cpu_s[WARMUP:]
    # the phases are wall-clock (the trainer's hooks): scaled to the step's CPU seconds, the clock compared
    share = statistics.median(c / s["time_s"] for c, s in zip(cpu_s, steps))
    phases = {p: share * statistics.median(s["phases"][p] for s in steps) for p in steps[0]["phases"]}
    plan = run.plan
    return {
        "name": point.name,
        "choices": list(point.choices),
        "tokens_per_step": job.data.seq_len * job.train.micro_batch * job.train.grad_accum,
        "overrides": list(point.overrides),
        "policy": plan.chosen.label,
        "precision": run.precision.name,
        "backend": trainer.attn.backend.value,
        "planned_s": plan.chosen.time.step_s,
        "source": plan.chosen.time.source,
        "measured_s": statistics.median(cpu_s),  # this process's CPU seconds: other jobs' load left out
        "measured_wall_s": statistics.median(s["time_s"] for s in steps),
        "terms_s": planned_step(run).terms,
        "phases_s": phases,
        "attended_fraction": plan.attention_pairs.as_dict()["fraction_of_row_squared"],
        "speed": [speed.as_dict() for speed in run.hardware.speed],
    }


def combine(rounds: list[dict]) -> dict:
    """One point's rounds as one row: the medians of its measured step and phases (the planned step is the same in
    every round: one device speed per process), and each round's measured step for the spread."""
    row = dict(rounds[0])
    row["measured_s"] = statistics.median(r["measured_s"] for r in rounds)
    row["measured_rounds_s"] = [r["measured_s"] for r in rounds]
    row["phases_s"] = {p: statistics.median(r["phases_s"][p] for r in rounds) for p in row["phases_s"]}
    return row


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among measured seconds)."""

    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0] * len(v)
        for r, i in enumerate(order):
            out[i] = r
        return out

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 2 else float("nan")


def term_checks(rows: list[dict]) -> list[dict]:
    """Planned against measured, term by term (see the module docstring)."""
    by = {r["name"]: r for r in rows}
    out = []
    for r in rows:
        t, p = r["terms_s"], r["phases_s"]
        compute = t["matmul"] + t["attention"] + t["pointwise"] + t["loss"] + t["recompute"]
        out.append(
            {"point": r["name"], "term": "compute", "planned": compute, "measured": p["forward"] + p["backward"]}
        )
        out.append({"point": r["name"], "term": "optimizer", "planned": t["optimizer"], "measured": p["optimizer"]})
    for name, base in (("full", "none S=512"), ("ops k=30", "none S=512"), ("S=1024 full", "S=1024")):
        if name in by and base in by:
            planned = by[name]["planned_s"] - by[base]["planned_s"]
            measured = by[name]["measured_s"] - by[base]["measured_s"]
            out.append({"point": f"{name} - {base}", "term": "recompute", "planned": planned, "measured": measured})
    for long, short in (("S=1024", "none S=512"), ("none S=512", "S=256")):
        if long in by and short in by:
            planned = by[long]["planned_s"] - 2 * by[short]["planned_s"]
            measured = by[long]["measured_s"] - 2 * by[short]["measured_s"]
            out.append(
                {"point": f"{long} - 2 x {short}", "term": "attention", "planned": planned, "measured": measured}
            )
    return out


def summarize(rows: list[dict]) -> dict:
    """Median |error|, rank correlation, and the choice sets' agreement (seconds per token: a row-length choice
    weighs an epoch's time, which is per token; within the other sets every point steps as many tokens)."""
    errors = [abs(r["planned_s"] / r["measured_s"] - 1) for r in rows]
    sets: dict[str, list[dict]] = {}
    for r in rows:
        for name in r["choices"]:
            sets.setdefault(name, []).append(r)
    agreement = []
    for name, members in sets.items():
        planned_best = min(members, key=lambda r: r["planned_s"] / r["tokens_per_step"])
        measured_best = min(members, key=lambda r: r["measured_s"] / r["tokens_per_step"])
        per_token = planned_best["measured_s"] / planned_best["tokens_per_step"]
        within = per_token <= 1.05 * measured_best["measured_s"] / measured_best["tokens_per_step"]
        agreement.append(
            {
                "set": name,
                "planned_fastest": planned_best["name"],
                "measured_fastest": measured_best["name"],
                "ok": within,
            }
        )
    return {
        "median_abs_error": statistics.median(errors),
        "spearman": spearman([r["planned_s"] for r in rows], [r["measured_s"] for r in rows]),
        "agreement_rate": sum(a["ok"] for a in agreement) / len(agreement) if agreement else None,
        "choice_sets": agreement,
    }


def to_markdown(rows: list[dict], summary: dict, terms: list[dict], speed: dict, wall_s: float) -> str:
    """The grid, the term checks and the targets as Markdown."""
    lines = [
        "## Planned against measured step time (CPU, 30 blocks at width 128)",
        "",
        (
            f"`OMP_NUM_THREADS=1 python bench/planner_time.py`: {len(rows)} points, {STEPS} measured steps each "
            f"after {WARMUP} warm-up step, the grid run {ROUNDS} times interleaved and each point's median round "
            f"taken (the rounds' spread is in the table), {wall_s / 60:.1f} min on a shared 2-core machine. Steps "
            "and the device speed (measured in the same process right before the grid) are both timed in this "
            "process's CPU seconds (FLEXENGINE_SPEED_CLOCK=process), so the other jobs' load is left out of both."
        ),
        "",
        (
            f"Device speed: {speed.get('source', 'none')}: matmul {speed.get('matmul_tflops', 0) * 1e3:.1f} "
            f"GFLOP/s, attention {(speed.get('attention_tflops') or 0) * 1e3:.1f} GFLOP/s, memory "
            f"{speed.get('memory_gb_s', 0):.1f} GB/s, AdamW {speed.get('optimizer_ns_per_param') or 0:.1f} ns/param."
        ),
        "",
        (
            f"**median |error| {summary['median_abs_error']:.1%}** (target <= 20 %), **Spearman "
            f"{summary['spearman']:.3f}** (>= 0.9), **fastest-plan agreement {summary['agreement_rate']:.0%}** of "
            f"{len(summary['choice_sets'])} choice sets (>= 90 %)."
        ),
        "",
        "| point | policy | precision | backend | planned s | measured s | rounds' spread | error |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        err = r["planned_s"] / r["measured_s"] - 1
        spread = max(r["measured_rounds_s"]) / min(r["measured_rounds_s"]) - 1
        lines.append(
            f"| {r['name']} | {r['policy']} | {r['precision']} | {r['backend']} | {r['planned_s']:.3f} | "
            f"{r['measured_s']:.3f} | {spread:.0%} | {err:+.0%} |"
        )
    lines += [
        "",
        "### Choice sets",
        "",
        (
            "The points the planner chooses between by its seconds on this CPU (memory=auto's policies, the "
            "micro-batch search, data.seq_len=auto's row lengths), compared per token. Not choice sets: the backends "
            "(attn.backend=auto is a rule), precision (precision=auto ranks modes by time on CUDA only) and the "
            "document mixes (the user's data); the run's plan prices backends and mixes alike (it is made before the "
            "documents are read, with one whole-row document per row)."
        ),
        "",
        "| set | planner's fastest | measured fastest | within 5 % |",
        "|---|---|---|---|",
    ]
    for a in summary["choice_sets"]:
        lines.append(
            f"| {a['set']} | {a['planned_fastest']} | {a['measured_fastest']} | {'yes' if a['ok'] else 'no'} |"
        )
    lines += ["", "### Term by term", "", "| term | point | planned s | measured s |", "|---|---|---:|---:|"]
    for t in terms:
        lines.append(f"| {t['term']} | {t['point']} | {t['planned']:.3f} | {t['measured']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Planned against measured seconds, one dot per point, with the 20 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    xs, ys = [r["measured_s"] for r in rows], [r["planned_s"] for r in rows]
    ax.scatter(xs, ys)
    for r in rows:
        ax.annotate(r["name"], (r["measured_s"], r["planned_s"]), fontsize=6)
    top = max(xs + ys) * 1.1
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.plot([0, top], [0, top * 1.2], "k:", lw=0.6)
    ax.plot([0, top], [0, top * 0.8], "k:", lw=0.6)
    ax.set(xlabel="measured step (s)", ylabel="planned step (s)", title="planner vs measured step time (CPU)")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    """Measure the device, run the grid, write bench/results/planner_time.{json,md,png}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three points only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import os

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["FLEXENGINE_SPEED_CACHE"] = str(root / "speed.json")  # measured now, in this process
        os.environ["FLEXENGINE_SPEED_CLOCK"] = "process"  # CPU seconds, as the steps are timed
        corpora = write_corpora(root)
        # the process's first run pays one-time costs its warm-up step does not absorb (allocator growth, lazy
        # imports, first kernels): measured at S=512 twice, the first point was ~12 % slower than the second
        measure(GRID[0], corpora, root / "warm-up")
        points = [p for p in GRID if not args.quick or p.name in QUICK]
        rounds = []
        for k in range(ROUNDS):  # interleaved: a drift in the machine's load falls on every point alike
            rounds.append([measure(point, corpora, root / f"round{k}-{i}") for i, point in enumerate(points)])
            for r in rounds[-1]:
                print(f"{k} {r['name']:<20} planned {r['planned_s']:.3f} s, measured {r['measured_s']:.3f} s")
        rows = [combine(list(same)) for same in zip(*rounds)]
        speed = json.loads((root / "speed.json").read_text())
    wall = time.perf_counter() - start
    summary, terms = summarize(rows), term_checks(rows)
    text = to_markdown(rows, summary, terms, (rows[0]["speed"] or [{}])[0], wall)
    print(text)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        report = {"summary": summary, "rows": rows, "terms": terms, "speed_cache": speed, "wall_s": wall}
        (RESULTS / "planner_time.json").write_text(json.dumps(report, indent=1))
        (RESULTS / "planner_time.md").write_text(text)
        plot(rows, RESULTS / "planner_time.png")


if __name__ == "__main__":
    main()
