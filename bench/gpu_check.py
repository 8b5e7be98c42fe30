"""Run the GPU checks (bench/gpu_check_list.py) in order within a time budget, streaming one JSON line per check.

One worker process (bench/gpu_check_scripts.py) runs the checks one after another, so flex and block compiles
are shared; it appends each check's JSON line to <out>/<prefix>.jsonl the moment the check ends. This driver
imports only the standard library and watches the worker: a check that outlives its cap (check_cap: up to 2x its
estimate while the decisive checks after it keep their turn) is killed (SIGTERM, SIGKILL 10 s later) and recorded
as `timed_out` with the last progress line it printed (how far it got: built, step 1, ...), never as `fail`; a
worker that dies (a CUDA error, an abort) has its check recorded as failed; either way a fresh worker resumes at
the next check. A worker whose check failed resets dynamo (a remembered frame skip would fail the next check
too) and, after a failure that is not an OOM, probes the device: dead, it exits (DEAD_DEVICE_EXIT) and a fresh
worker with a new CUDA context takes the next check. Inductor's and Triton's caches live in one directory for
the whole call (set before any worker starts), so a fresh worker finds the kernels the killed one compiled; a
directory the caller names (TORCHINDUCTOR_CACHE_DIR) is kept after the call, for a second call on the
still-warm machine. Checks the budget does not reach are recorded as `not_run`. At the end <prefix>.json (every
record + the environment) and <prefix>.md (a table) are
written from the lines; a cut-off run still leaves the .jsonl.

  python bench/gpu_check.py --out-dir $OUT [--budget-s 470] [--only NAME ...] [--dry-run [--fast]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_list import BY_NAME, CALL_BUDGET_S, CHECKS, DEAD_DEVICE_EXIT, RESERVE

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "gpu_check_scripts.py"
KILL_GRACE_S = 10  # SIGTERM first (the worker's finally blocks run), then SIGKILL
DRY_CAP_FACTOR = 8  # --dry-run: 2 CPU cores shared with other work, and CPU steps in place of GPU ones
WORKER_START_S = 10  # a new worker after a kill: python, torch, transformers, flexengine imported again
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")  # any set: the user's


def check_cap(names: list[str], left_s: float, scale: float = 1) -> float:
    """Seconds names[0] may run when `left_s` remain for it and the checks after it (names[1:]): its own cap
    (2x its estimate, x `scale` in the dry run) as long as the decisive checks after it keep RESERVE of their
    estimates (less one worker start-up each), and never less than its share of the time left in proportion to
    the decisive estimates. The other checks follow as time allows: none of them shortens an earlier check, so a
    slow cold compile early cannot leave a decisive check `not_run`, and time saved early goes to later checks."""
    first = BY_NAME[names[0]]
    later = [BY_NAME[n].expected_s for n in names[1:] if BY_NAME[n].decisive]
    share = left_s * first.expected_s / (first.expected_s + sum(later))
    # the later decisive checks' reserve and a worker restart for this check and each of them (each may be killed)
    keep = RESERVE * scale * sum(later) + (len(later) + 1) * WORKER_START_S if later else 0.0
    return min(left_s, max(share, min(first.cap_s * scale, left_s - keep)))


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
        self.progress: list[str] = []  # the running check's @@progress lines, "<seconds into it> s: <text>"
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
                self.current, self.started_at, self.progress = line.split()[1], time.monotonic(), []
            elif line.startswith("@@progress "):
                seconds = time.monotonic() - self.started_at
                self.progress.append(f"{seconds:.0f} s: {line[len('@@progress ') :].rstrip()}")
            elif line.startswith("@@done "):
                self.current = None
                print(line[len("@@done ") :].rstrip(), flush=True)

    def finish(self) -> int:
        """Wait for the output to drain; the exit status."""
        rc = self.proc.wait()
        self._reader.join(5)
        self._log.close()
        return rc


def timed_out_record(name: str, seconds: float, cap: float, worker: Worker, deadline: float) -> dict:
    """A check killed at its cap (or at the call's deadline): `timed_out`, with the last progress line it reached
    (a slow cold compile is not a failure of what the check tests; it says how far the check got)."""
    reason = f"its cap of {cap:.0f} s" if time.monotonic() < deadline else "the call's time budget"
    reached = worker.progress[-1] if worker.progress else "no progress line (still starting: imports, planning)"
    print(f"{name}: timed out after {seconds:.0f} s ({reason}), reached {reached}", flush=True)
    return {
        "check": name,
        "ok": False,
        "status": "timed_out",
        "seconds": round(seconds, 1),
        "cap_s": round(cap, 1),
        "error": f"killed at {reason}",
        "reached": reached,
        "progress": worker.progress,
        "tail": worker.tail[-15:],
    }


def run_checks(names: list[str], args, jsonl: Path, log_path: Path, deadline: float) -> None:
    """Run `names` in order across as many workers as crashes and timeouts need, within the deadline."""
    pending = list(names)
    while pending:
        left = deadline - time.monotonic()
        if left < 20:
            break
        flags = [*(["--dry-run"] if args.dry_run else []), *(["--fast"] if getattr(args, "fast", False) else [])]
        cmd = [sys.executable, str(WORKER), "--jsonl", str(jsonl), *flags, *pending]
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
        if rc == DEAD_DEVICE_EXIT:
            print("the device did not answer after a failed check: a fresh worker takes the next one", flush=True)
        if timed_out and timed_out[0] not in done:
            append_record(jsonl, timed_out_record(*timed_out, worker, deadline))
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
                    "progress": worker.progress if worker.current else [],
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
    """The final JSON: the environment, every check's record in list order, and the verdict. `ok` (the exit
    status) needs every decisive check to pass and no check to fail; a later check timed out or not reached is
    listed, not failed: those follow as time allows."""
    by_name = {r["check"]: r for r in records if "check" in r}
    checks = {}
    for name in names:
        r = dict(by_name.get(name, {"ok": False, "status": "not_run", "error": "no record"}))
        r.pop("check", None)
        r["expected_h200_s"] = BY_NAME[name].expected_s
        r["decisive"] = BY_NAME[name].decisive
        checks[name] = r
    # status: pass | fail | timed_out (killed at its cap: `reached` says how far) | skipped (this torch lacks what
    # the check needs: said in its record) | not_run (the call's budget ran out first)
    by_status = {s: [n for n, r in checks.items() if r.get("status") == s] for s in ("fail", "timed_out", "not_run")}
    decisive_ok = all(r.get("status") == "pass" for r in checks.values() if r["decisive"])
    return {
        "dry_run": dry_run,
        "env": checks.get("env", {}).get("env", {}),
        "total_s": round(total_s, 1),
        "expected_h200_total_s": sum(BY_NAME[n].expected_s for n in names),
        "expected_h200_decisive_s": sum(BY_NAME[n].expected_s for n in names if BY_NAME[n].decisive),
        "failed": by_status["fail"],
        "timed_out": {n: checks[n].get("reached") for n in by_status["timed_out"]},
        "not_run": by_status["not_run"],
        "skipped": {n: r.get("skipped") for n, r in checks.items() if r.get("status") == "skipped"},
        "decisive_ok": decisive_ok,
        "ok": decisive_ok and not by_status["fail"],
        "all_ok": not any(by_status.values()),
        "checks": checks,
    }


def _key_numbers(record: dict) -> str:
    """A short cell: its error or skip reason (if any), then its headline numbers."""
    said = str(record.get("error") or record.get("skipped") or "").splitlines()[:1]
    if record.get("status") == "timed_out":
        said = [f"{said[0] if said else 'timed out'}; reached {record.get('reached')}"]
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
            f"(H200 estimate for these checks: {result['expected_h200_total_s']} s, the decisive ones "
            f"{result['expected_h200_decisive_s']} s); ok={result['ok']} (decisive checks pass, none fails), "
            f"all_ok={result['all_ok']}"
        ),
        "",
        "| # | check | decisive | status | seconds here | of which compiling | H200 s (est.) | numbers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (name, r) in enumerate(result["checks"].items()):
        status = r.get("status", "?")
        seconds, compiling = (
            f"{r[k]:.1f}" if isinstance(r.get(k), (int, float)) else "-" for k in ("seconds", "compile_s")
        )
        decisive = "yes" if r["decisive"] else ""
        lines.append(
            f"| {i} | `{name}` | {decisive} | {status} | {seconds} | {compiling} | {r['expected_h200_s']} "
            f"| {_key_numbers(r)} |"
        )
    return "\n".join(lines) + "\n"


def call_environment() -> Path | None:
    """What every worker of this call runs under, set before the first one starts (a caller's own values are
    kept): Inductor's and Triton's caches in one directory, with the FX graph and AOT autograd caches on, so a
    worker started after a kill reads the kernels the killed one compiled; the allocator's expandable segments, as
    the engine's entry points set them. The directory is new for each call (the estimates are for a cold start,
    as on a fresh device machine); returns it to be removed at the end (None: the caller chose one)."""
    made = None
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        made = Path(tempfile.mkdtemp(prefix="flexengine-gpu-check-cache-", dir="/tmp"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(made / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "triton"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    # the entry points' default (flexengine/cli/__init__.py), here because the worker imports torch first
    if not any(name in os.environ for name in ALLOC_CONF_NAMES):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--budget-s", type=float, default=CALL_BUDGET_S, help="stop starting checks after this")
    parser.add_argument("--only", nargs="*", default=None, help="checks whose name contains one of these")
    parser.add_argument("--dry-run", action="store_true", help="CPU: imports, configs, each check's CPU part")
    parser.add_argument("--fast", action="store_true", help="with --dry-run: no CPU training steps (the CI test)")
    args = parser.parse_args()
    if args.fast and not args.dry_run:
        parser.error("--fast goes with --dry-run (a GPU run always trains)")
    start = time.monotonic()
    prefix = "gpu_check_dryrun" if args.dry_run else "gpu_check"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jsonl, log_path = args.out_dir / f"{prefix}.jsonl", args.out_dir / f"{prefix}.log"
    jsonl.unlink(missing_ok=True)
    log_path.unlink(missing_ok=True)
    names = [c.name for c in CHECKS if c.name == "env" or not args.only or any(o in c.name for o in args.only)]
    cache = call_environment()
    try:
        run_checks(names, args, jsonl, log_path, start + args.budget_s)
    finally:
        result = summarise(read_records(jsonl), names, time.monotonic() - start, args.dry_run)
        (args.out_dir / f"{prefix}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        (args.out_dir / f"{prefix}.md").write_text(markdown(result))
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
        print(
            f"ok={result['ok']} all_ok={result['all_ok']} failed={result['failed']} "
            f"timed_out={list(result['timed_out'])} not_run={result['not_run']} total {result['total_s']:.0f} s"
        )
        print(f"results: {args.out_dir / prefix}.{{jsonl,json,md,log}}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
