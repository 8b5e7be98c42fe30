"""Every GPU check of flexengine, each in its own process, within a time budget; one JSON whatever happens.

The driver imports nothing but the standard library, so a broken import or a CUDA error in one check cannot stop
the others or the JSON (it is rewritten after every check, and once more on the way out). Checks:
  pytest:<test>  every test marked `gpu`, one test function per process (tests/gpu/): flex backward == dense
                 backward, a compiled training step with 0 recompiles over 5 layouts, offload copies overlapping
                 compute (profiler timeline), the planner vs torch.cuda.max_memory_allocated on a full-width 7B,
                 precision=bf16_mixed vs fp32 over 12 steps at lr 2e-5 on a 32-layer LLaMA (bf16_pure must fail).
                 "No tests collected", a skip on a GPU machine or a collection error is a failure.
  step_time      compiled flex (packed rows) vs HF SDPA (the same documents, padded) at 8K, ~0.9B LLaMA
  doctor         `flexengine.doctor` on the GPU (tiny model, flex): verdicts, recompiles counted
  cp_grads       context parallelism: with 2 GPUs a parallel.cp=2 training step's gradients vs one process;
                 on 1 GPU (recorded: the 2-rank part skipped) torch's CP flex math with virtual ranks
Run through bench/gpu_check.sh. Usage: python bench/gpu_check.py --out bench/results/gpu_check.json [--budget-s 380]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_TESTS = "tests/gpu"  # where GPU-only tests live; collected with -m gpu
SCRIPT_CHECKS = {"step_time": 150, "doctor": 60, "cp_grads": 240}  # name -> timeout (s)
PYTEST_TIMEOUT_S = 150  # per test function (first compiles included)


def _run(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int, str]:
    """(exit code, last 40 lines of output); 124 on timeout."""
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=max(5.0, timeout_s),
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, "\n".join(out.splitlines()[-40:]) + f"\n[timed out after {timeout_s:.0f} s]"
    return proc.returncode, "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])


def collect_gpu_tests(timeout_s: float = 120) -> tuple[list[str], dict]:
    """Test functions marked gpu (parametrisations grouped), or an error record."""
    rc, out = _run(
        [sys.executable, "-m", "pytest", GPU_TESTS, "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        timeout_s,
    )
    ids = [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))]
    functions = sorted({re.sub(r"\[.*\]$", "", i) for i in ids})
    if rc != 0 or not functions:  # 5 = no tests collected: a vacuous pass is a failure here
        error = "no gpu tests collected" if rc == 5 else "collection failed"
        return [], {"ok": False, "returncode": rc, "error": error, "tail": out.splitlines()[-20:]}
    return functions, {"ok": True, "tests": functions}


def run_pytest_check(node: str, timeout_s: float) -> dict:
    """One gpu test function (all its parametrisations) in its own process; passes only if every case ran."""
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "junit.xml"
        rc, tail = _run(
            [
                sys.executable,
                "-m",
                "pytest",
                node,
                "-m",
                "gpu",
                "-q",
                "-s",
                "-p",
                "no:cacheprovider",
                f"--junitxml={xml}",
            ],
            timeout_s,
        )
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if xml.is_file():
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in counts}
    ran = counts["tests"] - counts["skipped"]
    ok = rc == 0 and ran > 0 and counts["skipped"] == 0 and counts["failures"] == counts["errors"] == 0
    numbers = [json.loads(line) for line in tail.splitlines() if line.startswith("{") and line.endswith("}")]
    return {
        "ok": ok,
        "returncode": rc,
        **counts,
        "printed": numbers,
        **({} if ok else {"tail": tail.splitlines()[-25:]}),
    }


def run_script_check(name: str, timeout_s: float) -> dict:
    """A scripted check (bench/gpu_check_scripts.py NAME) in its own process."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        rc, tail = _run([sys.executable, str(REPO / "bench" / "gpu_check_scripts.py"), name, str(out)], timeout_s)
        record = json.loads(out.read_text()) if out.is_file() else {"ok": False, "error": "no result written"}
    record["returncode"] = rc
    if rc != 0:
        record["ok"] = False
        record.setdefault("tail", tail.splitlines()[-25:])
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_check.json")
    parser.add_argument(
        "--budget-s", type=float, default=380.0, help="skip (as failed) checks that would start after this"
    )
    parser.add_argument("--only", nargs="*", default=None, help="run only checks whose name contains one of these")
    args = parser.parse_args()
    start = time.perf_counter()
    result: dict = {"env": {"python": sys.version.split()[0]}, "checks": {}, "all_ok": False}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["total_s"] = time.perf_counter() - start
        result["all_ok"] = bool(result["checks"]) and all(c.get("ok") for c in result["checks"].values())
        args.out.write_text(json.dumps(result, indent=2, default=str))

    try:
        probe = (
            "import json, torch; p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None; "
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'gpu': p.name if p else None, 'memory_gib': p.total_memory / 2**30 if p else None}))"
        )
        rc, env = _run([sys.executable, "-c", probe], 60)
        result["env"].update(json.loads(env.splitlines()[-1]) if rc == 0 else {"error": env})
        if not result["env"].get("gpu"):
            result["checks"]["cuda"] = {"ok": False, "error": "no CUDA device visible: nothing was checked"}
            return
        functions, collected = collect_gpu_tests()
        result["checks"]["collect"] = collected
        save()
        plan = [(f"pytest:{f.split('::')[-1]}", f, PYTEST_TIMEOUT_S) for f in functions]
        plan += [(name, None, t) for name, t in SCRIPT_CHECKS.items()]
        for name, node, timeout_s in plan:
            if args.only and not any(o in name for o in args.only):
                continue
            left = args.budget_s - (time.perf_counter() - start)
            if left < 30:
                result["checks"][name] = {"ok": False, "skipped": f"time budget: {left:.0f} s left"}
                continue
            t0 = time.perf_counter()
            budget = min(timeout_s, left)
            record = run_pytest_check(node, budget) if node else run_script_check(name, budget)
            record["seconds"] = time.perf_counter() - t0
            result["checks"][name] = record
            print(f"{name:>60}: {'ok' if record.get('ok') else 'FAILED'} ({record['seconds']:.0f} s)", flush=True)
            save()
    except Exception as e:  # the driver itself: still leave a JSON saying what broke
        result["checks"]["driver"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        save()
        print(f"all_ok={result['all_ok']} total {result['total_s']:.0f} s -> {args.out}")
    sys.exit(0 if result["all_ok"] else 1)


if __name__ == "__main__":
    main()
