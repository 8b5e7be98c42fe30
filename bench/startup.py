"""Start-up cost of each entry point: seconds to the first line of output and to the end of the command.

    python bench/startup.py [--repo DIR ...] [--repeat 3]

Each command runs in a fresh interpreter with PYTHONPATH=<repo> (so two checkouts, e.g. before/after a change,
are compared on the same machine, interleaved: run i of every repo before run i+1 of any). The data cache is
warmed once per repo first, so tokenization is not what is timed. Writes bench/results/startup.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAST = ["debug=fast", "data.num_workers=0"]
# (name, module args, marker of the first useful output: a substring of the line that shows real work)
COMMANDS = [
    ("train --help", ["-m", "flexengine.train", "--help"], None),
    ("train --cfg job", ["-m", "flexengine.train", "--cfg", "job", *FAST], None),
    (
        "train (1 step)",
        ["-m", "flexengine.train", *FAST, "train.max_steps=1", "train.save_final=false"],
        ("step 1 ", "done:"),
    ),
    ("plan 7B", ["-m", "flexengine.plan", "model=deepseek7b", "data.seq_len=6144", "hardware=a100_80g"], ("chosen",)),
    ("data.stats", ["-m", "flexengine.stats", *FAST], ("wrote",)),
    ("doctor (1 step)", ["-m", "flexengine.doctor", *FAST, "--steps", "1"], ("flexengine doctor",)),
]


def time_command(repo: Path, args: list[str], markers: tuple | None, workdir: Path, env: dict) -> dict:
    """Seconds to the first output line, to the marker line (if any), and to exit."""
    if "flexengine.doctor" in args:
        args = [*args, "--out", str(workdir)]
    elif "--help" not in args:
        args = [*args, f"hydra.run.dir={workdir}"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=workdir,
        env={**env, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = marked = None
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.perf_counter() - start
        lines.append(line)
        if first is None and line.strip():
            first = now
        if markers and marked is None and any(m in line for m in markers):
            marked = now
    rc = proc.wait()
    total = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"{args} failed ({rc}):\n{''.join(lines[-30:])}")
    return {"first_output_s": first, "useful_output_s": marked if markers else first, "total_s": total}


def main() -> None:
    """Time every command for every repo, interleaved; print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", type=Path, help="checkout(s) to compare (default: this one)")
    parser.add_argument("--label", action="append", help="a name per --repo (default: the directory name)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "startup")
    args = parser.parse_args()
    repos = args.repo or [Path(__file__).resolve().parents[1]]
    labels = args.label or [r.name for r in repos]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    results: dict = {label: {name: [] for name, _, _ in COMMANDS} for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        env["FLEXENGINE_CACHE"] = str(Path(tmp) / "cache")
        for repo in repos:  # warm the demo tokenizer + corpus cache (not part of start-up)
            time_command(repo, COMMANDS[2][1], None, Path(tempfile.mkdtemp(dir=tmp)), env)
        for _ in range(args.repeat):
            for name, cmd, marker in COMMANDS:
                for repo, label in zip(repos, labels):
                    results[label][name].append(time_command(repo, cmd, marker, Path(tempfile.mkdtemp(dir=tmp)), env))
    table = {
        label: {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in per.items()}
        for label, per in results.items()
    }
    lines = [
        "| command | "
        + " | ".join(f"{lb}: first output s | {lb}: useful output s | {lb}: total s" for lb in labels)
        + " |",
        "|---|" + "---|---|---|" * len(labels),
    ]
    for name, _, _ in COMMANDS:
        cells = []
        for label in labels:
            t = table[label][name]
            cells += [f"{t['first_output_s']:.1f}", f"{t['useful_output_s']:.1f}", f"{t['total_s']:.1f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    md = "\n".join(lines) + f"\n\nmedian of {args.repeat} runs, interleaved; machine: {os.cpu_count()} CPUs, shared\n"
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"median": table, "runs": results}, indent=1))
    args.out.with_suffix(".md").write_text(md)


if __name__ == "__main__":
    main()
