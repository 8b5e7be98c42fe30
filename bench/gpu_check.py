"""Run the GPU checks (bench/gpu_check_list.py) in order within a time budget, streaming one JSON line per check.

One worker process (bench/gpu_check_scripts.py) runs the checks one after another, so flex and block compiles
are shared; it appends each check's JSON line to <out>/<prefix>.jsonl the moment the check ends. This driver
imports only the standard library and watches the worker: a check that outlives its cap (check_cap: up to 2x its
estimate, a share of the time left) is killed (SIGTERM, SIGKILL 10 s later) and recorded as timed out; a worker
that dies (a CUDA error, an abort)
has its check recorded as failed; either way a fresh worker resumes at the next check. Checks the budget does
not reach are recorded as skipped. At the end <prefix>.json (every record + the environment) and <prefix>.md
(a table) are written from the lines; a cut-off run still leaves the .jsonl.

  python bench/gpu_check.py --out-dir $OUT [--budget-s 400] [--only NAME ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_list import BY_NAME, CALL_BUDGET_S, CHECKS, RESERVE

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "gpu_check_scripts.py"
KILL_GRACE_S = 10  # SIGTERM first (the worker's finally blocks run), then SIGKILL
DRY_CAP_FACTOR = 8  # --dry-run: 2 CPU cores shared with other work, and CPU steps in place of GPU ones
WORKER_START_S = 10  # a new worker after a kill: python, torch, transformers, flexengine imported again


def check_cap(names: list[str], left_s: float, scale: float = 1) -> float:
    """Seconds names[0] may run when `left_s` remain for it and the checks after it (names[1:]): its own cap
    (2x its estimate, x `scale` in the dry run) as long as the later checks keep RESERVE of their estimates
    (less one worker start-up each),
    and never less than its share of the time left in proportion to the estimates. So one slow compile cannot
    leave the decision-relevant checks after it `not_run`, and time saved early goes to the checks still to come."""
    estimates = [BY_NAME[n].expected_s for n in names]
    share = left_s * estimates[0] / sum(estimates)
    own = BY_NAME[names[0]].cap_s * scale
    # the later checks' reserve, the restart after this check if it is killed, and the next check's own restart
    keep = RESERVE * scale * sum(estimates[1:]) + 2 * WORKER_START_S
    return min(left_s, max(share, min(own, left_s - keep)))


def read_records(path: Path) -> list[dict]:
    """The JSON lines written so far (a line cut by a kill is dropped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def append_record(path: Path, record: dict) -> None:
    """Append one JSON line and make it durable (the driver's own records: timeouts, crashes, skips)."""
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM the worker's process group, SIGKILL it KILL_GRACE_S later (timeout -k semantics)."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class Worker:
    """One worker process over a list of checks; tells which check is running from its @@start lines."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.current: str | None = None
        self.started_at = time.monotonic()
        self.tail: list[str] = []
        self._log = log_path.open("a")
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: a kill takes its compile workers and torchrun too
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            self.tail = [*self.tail[-39:], line.rstrip()]
            if line.startswith("@@start "):
                self.current, self.started_at = line.split()[1], time.monotonic()
            elif line.startswith("@@done "):
                self.current = None
                print(line[len("@@done ") :].rstrip(), flush=True)

    def finish(self) -> int:
        """Wait for the output to drain; the exit status."""
        rc = self.proc.wait()
        self._reader.join(5)
        self._log.close()
        return rc


def run_checks(names: list[str], args, jsonl: Path, log_path: Path, deadline: float) -> None:
    """Run `names` in order across as many workers as crashes and timeouts need, within the deadline."""
    pending = list(names)
    while pending:
        left = deadline - time.monotonic()
        if left < 20:
            break
        cmd = [sys.executable, str(WORKER), "--jsonl", str(jsonl), *(["--dry-run"] if args.dry_run else []), *pending]
        worker = Worker(cmd, log_path)
        timed_out, caps = None, {}
        while worker.proc.poll() is None:
            time.sleep(0.5)
            name, started = worker.current, worker.started_at
            if name is None:
                continue
            if name not in caps:  # set once, when the check starts, from the time left then
                scale = DRY_CAP_FACTOR if args.dry_run else 1
                caps[name] = check_cap(pending[pending.index(name) :], deadline - started, scale)
            if time.monotonic() - started > caps[name] or time.monotonic() > deadline:
                timed_out = (name, time.monotonic() - started, caps[name])
                _kill(worker.proc)
                break
        rc = worker.finish()
        done = {r.get("check") for r in read_records(jsonl)}
        if timed_out and timed_out[0] not in done:
            name, seconds, cap = timed_out
            reason = f"its cap of {cap:.0f} s" if time.monotonic() < deadline else "the run's time budget"
            record = {"check": name, "ok": False, "status": "fail", "seconds": seconds, "cap_s": round(cap, 1)}
            append_record(jsonl, {**record, "error": f"killed at {reason}"})
            print(f"{name}: killed after {seconds:.0f} s ({reason})", flush=True)
        elif rc != 0 and (worker.current or pending[0]) not in done:
            # died inside a check (a crash, not a timeout), or before starting one (an import error): the check
            # it was on fails, so the next worker always makes progress
            name = worker.current or pending[0]
            when = "during this check" if worker.current else "before starting this check"
            append_record(
                jsonl,
                {
                    "check": name,
                    "ok": False,
                    "status": "fail",
                    "error": f"worker exited with status {rc} {when}",
                    "tail": worker.tail[-25:],
                },
            )
            print(f"{name}: worker died (exit {rc})", flush=True)
        done = {r.get("check") for r in read_records(jsonl)}
        pending = [n for n in pending if n not in done]
        if pending and rc == 0 and not timed_out:
            break  # a clean exit with checks left: the worker stopped them itself (e.g. no GPU); don't loop
    for name in pending:
        append_record(
            jsonl, {"check": name, "ok": False, "status": "not_run", "error": "not reached within the time budget"}
        )


def summarise(records: list[dict], names: list[str], total_s: float, dry_run: bool) -> dict:
    """The final JSON: the environment, every check's record in list order, and the verdict."""
    by_name = {r["check"]: r for r in records if "check" in r}
    checks = {}
    for name in names:
        r = dict(by_name.get(name, {"ok": False, "status": "not_run", "error": "no record"}))
        r.pop("check", None)
        r["expected_h200_s"] = BY_NAME[name].expected_s
        checks[name] = r
    # status: pass | fail | skipped (this torch lacks what the check needs: said in its record) | not_run
    failed = [n for n, r in checks.items() if r.get("status") in ("fail", "not_run")]
    return {
        "dry_run": dry_run,
        "env": checks.get("env", {}).get("env", {}),
        "total_s": round(total_s, 1),
        "expected_h200_total_s": sum(BY_NAME[n].expected_s for n in names),
        "failed": failed,
        "skipped": {n: r.get("skipped") for n, r in checks.items() if r.get("status") == "skipped"},
        "all_ok": not failed,
        "checks": checks,
    }


def _key_numbers(record: dict) -> str:
    """A short cell: its error or skip reason (if any), then its headline numbers."""
    said = str(record.get("error") or record.get("skipped") or "").splitlines()[:1]
    headline = record.get("headline", {})
    numbers = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in headline.items())
    return " | ".join([*(s[:160] for s in said), *([numbers[:300]] if numbers else [])])


def markdown(result: dict) -> str:
    """The result as a Markdown report."""
    env = result["env"]
    title = "GPU check, dry run on CPU" if result["dry_run"] else "GPU check"
    lines = [
        f"# {title}",
        "",
        (
            f"torch {env.get('torch')}, transformers {env.get('transformers')}, python {env.get('python')}, "
            f"device {env.get('gpu') or 'cpu'}; total {result['total_s']:.0f} s "
            f"(H200 estimate for these checks: {result['expected_h200_total_s']} s); all_ok={result['all_ok']}"
        ),
        "",
        "| # | check | status | seconds here | of which compiling | H200 s (est.) | numbers |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (name, r) in enumerate(result["checks"].items()):
        status = r.get("status", "?")
        seconds, compiling = (
            f"{r[k]:.1f}" if isinstance(r.get(k), (int, float)) else "-" for k in ("seconds", "compile_s")
        )
        lines.append(
            f"| {i} | `{name}` | {status} | {seconds} | {compiling} | {r['expected_h200_s']} | {_key_numbers(r)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--budget-s", type=float, default=CALL_BUDGET_S, help="stop starting checks after this")
    parser.add_argument("--only", nargs="*", default=None, help="checks whose name contains one of these")
    parser.add_argument("--dry-run", action="store_true", help="CPU: imports, configs, each check's CPU part")
    args = parser.parse_args()
    start = time.monotonic()
    prefix = "gpu_check_dryrun" if args.dry_run else "gpu_check"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jsonl, log_path = args.out_dir / f"{prefix}.jsonl", args.out_dir / f"{prefix}.log"
    jsonl.unlink(missing_ok=True)
    log_path.unlink(missing_ok=True)
    names = [c.name for c in CHECKS if c.name == "env" or not args.only or any(o in c.name for o in args.only)]
    try:
        run_checks(names, args, jsonl, log_path, start + args.budget_s)
    finally:
        result = summarise(read_records(jsonl), names, time.monotonic() - start, args.dry_run)
        (args.out_dir / f"{prefix}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        (args.out_dir / f"{prefix}.md").write_text(markdown(result))
        print(f"all_ok={result['all_ok']} failed={result['failed']} total {result['total_s']:.0f} s")
        print(f"results: {args.out_dir / prefix}.{{jsonl,json,md,log}}")
    sys.exit(0 if result["all_ok"] else 1)


if __name__ == "__main__":
    main()
