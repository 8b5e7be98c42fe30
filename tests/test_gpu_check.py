"""bench/gpu_check.sh on the CPU, fast: every config its checks compose, every import its worker needs, the
comparators each check passes or fails on (with the broken variants they must catch), the driver's streaming /
kill / resume logic with a stand-in worker, and the dry run's fast subset through the real driver and worker
(the README plan at the A100's budget planned, pinned and capped; flex vs dense; the overlap reader). The whole
dry run (`bash bench/gpu_check.sh --dry-run`, output in bench/results/gpu_check_dryrun.*) is not run here."""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

import pytest

from flexengine.planning.budget import DeviceBudget

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
import gpu_check_list  # noqa: E402
import gpu_check_readme as readme  # noqa: E402
import gpu_check_scripts as scripts  # noqa: E402
import gpu_check_width as width  # noqa: E402
import gpu_overlap  # noqa: E402


def all_job_overrides() -> dict[str, list[str]]:
    """Every job the GPU run and the dry run compose."""
    jobs = dict(width.job_overrides())
    for dry in (False, True):
        tag = "dry" if dry else "gpu"
        jobs[f"recompiles/{tag}"] = scripts.recompile_overrides(dry, 512)
        jobs[f"doctor/{tag}"] = scripts.doctor_overrides(dry)
        cmd = scripts.fsdp_smoke_command(dry, Path("/tmp/x"))
        jobs[f"fsdp_smoke/{tag}"] = [a for a in cmd[cmd.index("flexengine.train") + 1 :] if not a.startswith("hydra.")]
    for mode in width.MODES:
        jobs[f"train_modes/dry/{mode}"] = width.train_dry_overrides(mode)
    for policy in ("none", "full"):
        jobs[f"planner_vs_allocator/dry/{policy}"] = width.allocator_dry_overrides(policy)
    return jobs


@pytest.mark.parametrize("key", sorted(all_job_overrides()))
def test_every_gpu_check_job_composes(key):
    from flexengine.cli.common import compose_job

    job = compose_job(all_job_overrides()[key])
    assert job.model.arch or job.model.path  # composed and validated into a JobConfig


def test_the_worker_imports_everything_the_checks_need():
    record = scripts.check_env(dry=True)
    assert record["ok"], record["import_errors"]
    assert record["env"]["versions"]["torchao"] and record["env"]["versions"]["hydra"]


def test_bench_readme_shows_the_check_list_as_it_is():
    assert gpu_check_list.markdown_table() in (REPO / "bench" / "README.md").read_text()


DECISIVE = ["env", "readme_a100", "flex_vs_dense", "planner_vs_allocator", "recompiles"]


def test_the_check_list_and_the_worker_name_the_same_checks_in_order():
    names = [c.name for c in gpu_check_list.CHECKS]
    assert list(scripts.checks()) == names
    assert names[: len(DECISIVE)] == DECISIVE  # the README's plan at the A100's budget right after env
    assert [c.name for c in gpu_check_list.CHECKS if c.decisive] == DECISIVE
    assert names[len(DECISIVE) : len(DECISIVE) + 2] == ["train_bf16_sr", "train_bf16_mixed"]
    later = [names.index(n) for n in ("offload_overlap", "cp_grads", "doctor")]
    assert max(later) < min(names.index(f"train_{m}") for m in ("bf16_cpu_master", "fp32", "bf16_pure"))
    assert all(c.basis for c in gpu_check_list.CHECKS)  # every estimate says how it was made


def test_the_decisive_checks_fit_300_s_cold_and_the_call_budget_with_their_caps_left():
    budget = gpu_check_list.CALL_BUDGET_S
    assert f"GPU_CHECK_BUDGET_S:-{budget}}}" in (REPO / "bench" / "gpu_check.sh").read_text()
    assert gpu_check_list.decisive_seconds() <= gpu_check_list.DECISIVE_BUDGET_S == 300
    assert gpu_check_list.decisive_seconds() + 20 < budget  # the driver's end reserve, and time for the rest


def test_check_cap_keeps_a_turn_for_the_decisive_checks_after_overrunning_ones():
    """Every decisive check runs until it is killed (and a new worker takes 10 s to start): the decisive checks
    after it still get RESERVE of their estimates (less a start-up); the later, non-decisive checks never shorten
    a decisive one; on schedule a check gets 2x its estimate, and time saved early goes to the later checks."""
    names = [c.name for c in gpu_check_list.CHECKS]
    left = gpu_check_list.CALL_BUDGET_S - 20.0
    assert gpu_check.check_cap(names, left) == gpu_check_list.BY_NAME["env"].cap_s  # on schedule: its own cap
    readme_a100 = gpu_check_list.BY_NAME["readme_a100"]  # a slow cold start: close to twice its estimate
    assert gpu_check.check_cap(names[1:], left - 10) >= 1.75 * readme_a100.expected_s
    for i, name in enumerate(DECISIVE):
        cap = gpu_check.check_cap(names[i:], left)
        keeps = gpu_check_list.RESERVE * gpu_check_list.BY_NAME[name].expected_s - gpu_check.WORKER_START_S
        assert cap >= keeps - 1e-9, (name, cap)
        left -= cap + gpu_check.WORKER_START_S
    assert left >= -gpu_check.WORKER_START_S  # the last decisive check took what was left, no more
    last = names[-1]
    assert gpu_check.check_cap([last], 100.0) == 100.0 > gpu_check_list.BY_NAME[last].cap_s  # time saved early


def test_every_decisive_check_finishes_with_slow_cold_compiles_and_a_hang_leaves_the_rest_their_estimates():
    """The call's 480 s: each decisive check taking SLOW_COMPILES x its estimate runs to its end under its cap, all
    five within the checks' time (the call less the driver's end reserve and the wheels' install); one that hangs
    until its cap (then a fresh worker) still leaves every decisive check after it its whole estimate."""
    names = [c.name for c in gpu_check_list.CHECKS]
    assert names[: len(DECISIVE)] == DECISIVE
    assert gpu_check_list.CALL_BUDGET_S + 5 < 480  # bench/gpu_check.sh's timeout -k 5: inside timeout_s 480
    slow = gpu_check_list.SLOW_COMPILES
    for hung in [None, *DECISIVE]:
        left = gpu_check_list.CALL_BUDGET_S - 20.0 - 5
        for i, name in enumerate(DECISIVE):
            cap, estimate = gpu_check.check_cap(names[i:], left), gpu_check_list.BY_NAME[name].expected_s
            if hung is None:
                assert cap >= slow * estimate, (name, cap)
            elif i > DECISIVE.index(hung):
                assert cap >= estimate, (hung, name, cap)
            restart = gpu_check.WORKER_START_S if i < len(DECISIVE) - 1 else 0  # for the next decisive check
            left -= cap + restart if name == hung else (slow if hung is None else 1) * estimate
        assert left >= 0, (hung, left)


def test_a_call_without_wheels_stops_in_seconds_naming_the_script(tmp_path):
    import subprocess
    import time

    fake = tmp_path / "python3"  # an interpreter without the carried packages
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT": str(tmp_path), "GPU_CHECK_SITE": str(tmp_path / "s")}
    repo = tmp_path / "repo"  # a fresh checkout: no .whl/
    (repo / "bench").mkdir(parents=True)
    (repo / "bench" / "gpu_check.sh").write_text((REPO / "bench" / "gpu_check.sh").read_text())
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(repo / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and time.monotonic() - t0 < 10
    assert "scripts/prepare_gpu_wheels.sh" in proc.stderr


def test_a_worker_whose_check_kills_the_device_records_it_and_exits_for_a_fresh_one(tmp_path, monkeypatch):
    """A check that leaves the CUDA context dead (faked: the probe says so) is recorded failed, dynamo is reset,
    and the worker exits with DEAD_DEVICE_EXIT before the next check; an OOM does not probe, and a live device
    after a failure keeps the worker going."""
    ran, resets = [], []

    def crash(dry):
        ran.append("crash")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def after(dry):
        ran.append("after")
        return {"ok": True}

    monkeypatch.setattr(scripts, "checks", lambda: {"env": lambda dry: {"ok": True}, "a": crash, "b": after})
    monkeypatch.setattr(scripts.torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(scripts, "device_alive", lambda: False)
    jsonl = tmp_path / "w.jsonl"
    monkeypatch.setattr(sys, "argv", ["w", "--jsonl", str(jsonl), "--dry-run", "env", "a", "b"])
    with pytest.raises(SystemExit) as exit_:
        scripts.main()
    assert exit_.value.code == gpu_check_list.DEAD_DEVICE_EXIT and ran == ["crash"] and resets == [1]
    records = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [(r["check"], r["status"]) for r in records] == [("env", "pass"), ("a", "fail")]
    assert "illegal memory access" in records[1]["error"]
    assert scripts.after_failure({"error": "OutOfMemoryError: CUDA out of memory"})  # no probe after an OOM
    monkeypatch.setattr(scripts, "device_alive", lambda: True)
    jsonl.unlink()
    scripts.main()  # alive: the next check runs in the same worker
    assert ran == ["crash", "crash", "after"]


def test_env_fails_only_on_a_decisive_checks_import_and_warns_on_the_rest(monkeypatch):
    real = scripts.importlib.import_module

    def missing(names):
        def imp(name, *args):
            if name in names:
                raise ImportError(f"No module named {name!r}")
            return real(name, *args)

        return imp

    monkeypatch.setattr(scripts.importlib, "import_module", missing({"peft", "pyarrow"}))
    record = scripts.check_env(dry=True)
    assert record["ok"] and set(record["import_warnings"]) == {"peft", "pyarrow"} and not record["import_errors"]
    assert set(record["env"]["host_memory_gib"]) == {"MemTotal", "MemAvailable"}
    monkeypatch.setattr(scripts.importlib, "import_module", missing({"omegaconf"}))
    record = scripts.check_env(dry=True)
    assert not record["ok"] and "omegaconf" in record["error"]


def test_the_allocator_check_shape_lets_a_halved_activation_term_show():
    """At 7B width the planner's activation share decides whether +-10 % can catch a halved term: the check's
    shape must move the total by twice the tolerance (2 layers at 8K moves it by barely more than the tolerance)."""
    overrides = width.width_overrides(8, width.ALLOCATOR_SEQ_LEN, "precision.mode=bf16_mixed", "memory=none")
    terms = width.plan_for_gpu(overrides)["terms"]
    planned = sum(terms.values())
    assert terms["activation_bytes"] / 2 / planned > 2 * width.MEMORY_RTOL, terms
    assert width.plan_for_gpu(width.job_overrides()["planner_vs_allocator/none"])["fits"]


def test_every_precision_mode_is_planned_to_fit_one_h200_at_the_check_shape():
    for mode in width.MODES:
        plan = width.plan_for_gpu(width.job_overrides()[f"train_modes/{mode}"])
        assert plan["fits"] and plan["precision"] == mode, plan


def _gib(x: float) -> int:
    return int(x * 2**30)


def _run(**given) -> dict:
    """A run_steps record of a 7B-width step that matched its plan (GiB given as floats, bytes recorded)."""
    terms = {"weights_bytes": 13.0, "grads_bytes": 13.0, "optimizer_bytes": 39.0, "activation_bytes": 8.7}
    gib = {
        "planned_device_bytes": 73.7,
        "planned_margin_bytes": 3.96,
        "measured_device_bytes": 74.0,
        "max_allocated_bytes": 74.0,
        "max_reserved_bytes": 76.0,
        "between_steps_bytes": 52.0,
    }
    gib |= {k: v for k, v in given.items() if k.endswith("_bytes")}
    run = {"alloc_retries": 0, "ooms": 0, "finite": True, "planned_step_s": 6.0, "step_s": 3.6, "mfu": 0.39}
    run |= {k: v for k, v in given.items() if not k.endswith("_bytes")}
    return {"planned_terms": {k: _gib(v) for k, v in terms.items()}, **{k: _gib(v) for k, v in gib.items()}, **run}


A100_BUDGET = DeviceBudget(card_bytes=_gib(79.15), context_bytes=_gib(0.8), margin_bytes=_gib(3.96))
A100_PLANNED = _gib(73.7)  # the plan's allocated peak within that budget


def test_the_readme_check_passes_a_run_within_the_plan_and_fails_retries_a_reserved_overrun_and_an_undercount():
    cap = readme.allocator_cap(A100_BUDGET, A100_PLANNED, _gib(139.8))
    assert cap["cap_gib"] == pytest.approx(78.35, abs=1e-6) and cap["fraction"] == pytest.approx(78.35 / 139.8)
    good = readme.memory_report(_run(), cap)
    assert readme.problems_of(_run(), good) == [], good
    assert good["static_over_plan"] == pytest.approx(1.0) and good["reserved_headroom_gib"] == pytest.approx(2.35)
    for bad, said in (
        (_run(alloc_retries=3), "cudaMalloc retries"),
        (_run(max_reserved_bytes=78.0), "outgrew the margin"),  # 78 > 73.7 planned + 3.96 margin
        (_run(measured_device_bytes=82.0, max_allocated_bytes=82.0, max_reserved_bytes=82.0), "under-counts"),
        (_run(finite=False), "non-finite"),
    ):
        problems = readme.problems_of(bad, readme.memory_report(bad, cap))
        assert any(said in p for p in problems), (said, problems)
    oom = {"oom": True, "reached": "step 1 (warm-up: compiles) in 80.0 s"}
    assert readme.problems_of(oom, {"cap_gib": cap["cap_gib"]}) == [
        "out of memory at 78.35 GiB, after: step 1 (warm-up: compiles) in 80.0 s"
    ]


def test_the_a100_cap_comes_from_the_plan_never_past_the_device():
    budget = DeviceBudget(card_bytes=100, context_bytes=10, margin_bytes=10)
    assert readme.allocator_cap(budget, 70, 200)["cap_bytes"] == 90  # the card less its context: budget + margin
    with pytest.raises(ValueError, match="does not fit"):
        readme.allocator_cap(budget, 70, 50)


def test_memory_verdict_passes_the_planner_and_fails_it_with_the_activation_term_halved():
    terms = {"weights_bytes": 40, "grads_bytes": 40, "activation_bytes": 100}
    good = width.memory_verdict(terms, measured=185)  # within 10 % of 180
    halved = width.memory_verdict(dict(terms, activation_bytes=50), measured=185)
    assert good["ok"] and good["halved_activation_caught"]
    assert not halved["ok"]


def test_a_train_mode_fails_a_plan_that_under_counts_or_over_counts_its_peak():
    assert width.peak_problems(1.0) == [] and width.peak_problems(0.85) == []
    assert "under-counts" in width.peak_problems(1.2)[0]
    assert "too pessimistic" in width.peak_problems(0.5)[0]  # the old pass line (<= 1.10 only) passed this


def test_overlap_verdict_passes_only_copies_that_run_beside_compute():
    demo = gpu_overlap.synthetic_demo()
    assert demo["ok"], demo
    assert "no copy on a side stream" in demo["cases"]["same_stream"]["verdict"]["reasons"][0]
    assert demo["cases"]["serialised"]["verdict"]["overlap_of_possible"] == 0.0


def test_overlap_verdict_does_not_count_device_to_device_copies_as_offload():
    events = gpu_overlap.synthetic_timeline("same_stream")
    events.append(gpu_overlap._event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 20, 10, 50))
    assert not gpu_overlap.overlap_verdict(events)["ok"]  # still no offload copy on a side stream


def test_overlap_verdict_fails_a_pageable_batch_copy():
    events = gpu_overlap.synthetic_timeline("overlapped")
    events[0]["name"] = "Memcpy HtoD (Pageable -> Device)"
    verdict = gpu_overlap.overlap_verdict(events)
    assert not verdict["ok"] and any("Pageable" in r for r in verdict["reasons"])


def test_compile_watch_counts_a_record_that_reuses_a_dropped_records_id(monkeypatch):
    """dynamo keeps its newest 64 compile records; a new record can take a dropped one's address. Counting by
    id() took it for already seen (the recompile was missed)."""
    import torch._dynamo.utils as dynamo_utils

    from flexengine.surgery.compile import CompileWatch

    class Record:
        __slots__ = ("recompile_reason",)  # no __dict__: same-size objects reuse freed slots

        def __init__(self, reason):
            self.recompile_reason = reason

    records = collections.deque([Record(None)], maxlen=1)
    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics", lambda: list(records))
    watch = CompileWatch()
    records.append(Record("size mismatch"))  # the first record is dropped (and freed, unless the watch keeps it)
    records.append(Record("size mismatch"))  # typically lands where the first one was
    assert watch.stats().recompiles == 1


FAKE_WORKER = """
import json, os, sys, time
args = sys.argv[1:]
if args[2] == "recompiles" and not os.path.exists(args[1] + ".restarted"):
    open(args[1] + ".restarted", "w").close()
    sys.exit(3)  # dies before its first check (an import error): that check fails, the next worker goes on
jsonl = args[args.index("--jsonl") + 1]
names = [a for a in args[args.index("--jsonl") + 2 :] if a != "--dry-run"]
for name in names:
    print("@@start " + name, flush=True)
    if name == "train_bf16_mixed":
        print("@@progress built", flush=True)
        print("@@progress step 1 (warm-up: compiles)", flush=True)
        time.sleep(60)  # hangs (a slow cold compile): killed at its cap, recorded timed_out, the next check resumes
    if name == "flex_vs_dense":
        os._exit(7)  # dies inside the check (a CUDA abort)
    with open(jsonl, "a") as f:
        f.write(json.dumps({"check": name, "ok": True, "status": "pass"}) + "\\n")
    print("@@done " + name, flush=True)
"""


def test_the_driver_records_a_hang_and_a_crash_and_resumes_at_the_next_check(tmp_path, monkeypatch):
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(FAKE_WORKER))
    monkeypatch.setattr(gpu_check, "WORKER", worker)
    monkeypatch.setattr(gpu_check, "KILL_GRACE_S", 1)

    @dataclasses.dataclass
    class Fast:
        cap_s: float = 2.0
        expected_s: int = 1
        decisive: bool = True

    monkeypatch.setattr(gpu_check, "BY_NAME", collections.defaultdict(Fast))
    monkeypatch.setattr(gpu_check, "check_cap", lambda names, left_s, scale=1: 2.0)  # its own test above
    names = ["env", "train_bf16_mixed", "flex_vs_dense", "recompiles", "doctor"]
    jsonl = tmp_path / "out.jsonl"
    args = type("Args", (), {"dry_run": False})()
    import time

    gpu_check.run_checks(names, args, jsonl, tmp_path / "log", time.monotonic() + 60)
    records = {r["check"]: r for r in (json.loads(x) for x in jsonl.read_text().splitlines())}
    assert list(records) == names  # streamed in order, one line each
    hung = records["train_bf16_mixed"]
    assert hung["status"] == "timed_out" and "killed" in hung["error"]  # never `fail`: it says how far it got
    assert hung["reached"].endswith("step 1 (warm-up: compiles)") and len(hung["progress"]) == 2
    assert "status 7" in records["flex_vs_dense"]["error"] and records["flex_vs_dense"]["status"] == "fail"
    assert "status 3 before starting" in records["recompiles"]["error"]
    assert all(records[n]["status"] == "pass" for n in ("env", "doctor"))
    result = gpu_check.summarise(list(records.values()), names, 1.0, False)
    assert result["failed"] == ["flex_vs_dense", "recompiles"] and list(result["timed_out"]) == ["train_bf16_mixed"]
    assert not result["ok"] and not result["all_ok"]


def test_the_verdict_needs_the_decisive_checks_and_lists_later_ones_not_reached():
    names = [c.name for c in gpu_check_list.CHECKS]
    passed = [{"check": n, "status": "pass", "ok": True} for n in DECISIVE]
    result = gpu_check.summarise(passed, names, 1.0, False)  # the rest: no record (not reached)
    assert result["ok"] and not result["all_ok"] and result["not_run"] == names[len(DECISIVE) :]
    late = [*passed, {"check": "fsdp_smoke", "status": "timed_out", "reached": "built"}]
    assert gpu_check.summarise(late, names, 1.0, False)["ok"]  # a later check timed out: listed, not failed
    slow = [*passed[:1], {"check": "readme_a100", "status": "timed_out", "reached": "built"}, *passed[2:]]
    assert not gpu_check.summarise(slow, names, 1.0, False)["ok"]  # a decisive one did not pass


def _dry_run(tmp_path: Path, only: list[str], *flags: str) -> tuple[dict, str]:
    """bench/gpu_check.py --dry-run through the real driver and worker, cold (no inherited compile cache)."""
    import os
    import subprocess

    cmd = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run", *flags, "--out-dir", str(tmp_path)]
    cmd += ["--budget-s", "2400"]  # bench/gpu_check.sh's dry-run budget (2 shared cores): the caps scale with it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    proc = subprocess.run([*cmd, "--only", *only], capture_output=True, text=True, timeout=1500, env=env, cwd=REPO)
    result = json.loads((tmp_path / "gpu_check_dryrun.json").read_text())
    assert proc.returncode == 0 and result["all_ok"], (proc.stdout[-3000:], result["failed"])
    assert list(result["checks"]) == ["env", *only]
    return result, proc.stdout


def test_the_dry_runs_fast_subset_passes_through_the_driver(tmp_path):
    """The overlap reader's CPU part through the driver, and the call's environment: one compile cache for the
    whole call, removed at its end when the driver made it."""
    result, _ = _dry_run(tmp_path, ["offload_overlap"], "--fast")
    call_env = result["env"]["call_env"]
    assert call_env["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp/flexengine-gpu-check-cache-")
    assert not Path(call_env["TORCHINDUCTOR_CACHE_DIR"]).parent.exists()
    assert call_env["PYTORCH_CUDA_ALLOC_CONF"] or call_env["PYTORCH_ALLOC_CONF"] is not None


@pytest.mark.slow
def test_every_decisive_checks_cpu_part_passes_through_the_driver_in_one_worker(tmp_path):
    """What `bash bench/gpu_check.sh --dry-run` decides, in CI: env, the README plan at the A100's budget (planned
    at grad_accum 8 and 2, pinned, re-planned, built on meta, capped, then trained at a tiny width with its
    compiled SAC + offload blocks under the CPU meter), flex vs dense, planner vs allocator, and recompiles after
    it in the same worker (a frame skip the meter left behind would fail it). Fails when a check's CPU part
    breaks, e.g. the meter clashing with compiled blocks."""
    result, _ = _dry_run(tmp_path, DECISIVE[1:])
    check = result["checks"]["readme_a100"]
    assert check["same_choices_as_readme"] and check["replanned"]["same"] and check["model_on_meta"]["layers"] == 30
    assert check["plan"]["grad_accum"] == readme.GRAD_ACCUM and check["readme_plan"]["grad_accum"] == 8
    assert check["plan"]["allocated_gib"] < check["cap"]["cap_gib"] < check["cap"]["device_total_gib"]
    assert "planned: precision=" in check["progress"][0]  # "<seconds into the check> s: planned: ..."
    assert check["run"]["finite"] and check["compile"]["skipped_blocks"] == 0
    assert result["checks"]["recompiles"]["steady"]["recompiles"] == 0
