"""bench/gpu_check.sh on the CPU, fast: every config its checks compose, every import its worker needs, the
comparators each check passes or fails on (with the broken variants they must catch), and the driver's
streaming / kill / resume logic with a stand-in worker. The checks' own CPU parts run in the dry run
(`bash bench/gpu_check.sh --dry-run`, output in bench/results/gpu_check_dryrun.*), not here."""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
import gpu_check_list  # noqa: E402
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


def test_the_check_list_and_the_worker_name_the_same_checks_in_order():
    names = [c.name for c in gpu_check_list.CHECKS]
    assert names[0] == "env" and list(scripts.checks()) == names
    assert names[1:3] == ["train_bf16_sr", "train_bf16_mixed"]  # what precision=auto picks, then the default
    decisive = [names.index(n) for n in ("planner_vs_allocator", "offload_overlap", "cp_grads", "doctor")]
    assert max(decisive) < min(names.index(f"train_{m}") for m in ("bf16_cpu_master", "fp32", "bf16_pure"))


def test_the_estimates_leave_a_margin_in_the_calls_budget():
    budget = gpu_check_list.CALL_BUDGET_S
    assert f"GPU_CHECK_BUDGET_S:-{budget}}}" in (REPO / "bench" / "gpu_check.sh").read_text()
    assert sum(c.expected_s for c in gpu_check_list.CHECKS) <= (1 - gpu_check_list.MARGIN) * budget


def test_check_cap_keeps_a_turn_for_the_checks_after_overrunning_ones():
    """Every check before doctor runs until it is killed (and a new worker takes 10 s to start): the checks
    that decide the most after the train modes still get RESERVE of their estimates (less a start-up); on
    schedule a check gets 2x its estimate, and time saved early goes to the later checks."""
    names = [c.name for c in gpu_check_list.CHECKS]
    left = gpu_check_list.CALL_BUDGET_S - 20.0
    assert gpu_check.check_cap(names, left) == gpu_check_list.BY_NAME["env"].cap_s  # on schedule: its own cap
    for i, name in enumerate(names[: names.index("doctor") + 1]):
        cap = gpu_check.check_cap(names[i:], left)
        keeps = gpu_check_list.RESERVE * gpu_check_list.BY_NAME[name].expected_s - gpu_check.WORKER_START_S
        assert cap >= keeps - 1e-9, (name, cap)
        left -= cap + gpu_check.WORKER_START_S
    assert left > 0
    last = names[-1]
    assert gpu_check.check_cap([last], 100.0) == 100.0 > gpu_check_list.BY_NAME[last].cap_s  # time saved early


def test_the_allocator_check_shape_lets_a_halved_activation_term_show_and_2_layers_did_not():
    """At 7B width the planner's activation share decides whether +-10 % can catch a halved term: the check's
    shape must move the total by twice the tolerance; the old 2-layer shape stayed inside it."""
    moved = {}
    for layers, seq_len in ((2, 8192), (8, width.ALLOCATOR_SEQ_LEN)):
        overrides = width.width_overrides(layers, seq_len, "precision.mode=bf16_mixed", "memory=none")
        terms = width.plan_for_gpu(overrides)["terms"]
        planned = sum(v for k, v in terms.items() if k != "cuda_reserve_bytes")
        moved[layers] = terms["activation_bytes"] / 2 / planned
    assert moved[8] > 2 * width.MEMORY_RTOL, moved
    assert moved[2] < width.MEMORY_RTOL, moved
    assert width.plan_for_gpu(width.job_overrides()["planner_vs_allocator/none"])["fits"]


def test_every_precision_mode_is_planned_to_fit_one_h200_at_the_check_shape():
    for mode in width.MODES:
        plan = width.plan_for_gpu(width.job_overrides()[f"train_modes/{mode}"])
        assert plan["fits"] and plan["precision"] == mode, plan


def test_memory_verdict_passes_the_planner_and_fails_it_with_the_activation_term_halved():
    terms = {"weights_bytes": 40, "grads_bytes": 40, "activation_bytes": 100, "cuda_reserve_bytes": 1000}
    good = width.memory_verdict(terms, measured=185)  # within 10 % of 180 (the reserve is left out)
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
        time.sleep(60)  # hangs: the driver must kill it at its cap and resume with the next check
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

    monkeypatch.setattr(gpu_check, "BY_NAME", collections.defaultdict(Fast))
    monkeypatch.setattr(gpu_check, "check_cap", lambda names, left_s, scale=1: 2.0)  # its own test above
    names = ["env", "train_bf16_mixed", "flex_vs_dense", "recompiles", "doctor"]
    jsonl = tmp_path / "out.jsonl"
    args = type("Args", (), {"dry_run": False})()
    import time

    gpu_check.run_checks(names, args, jsonl, tmp_path / "log", time.monotonic() + 60)
    records = {r["check"]: r for r in (json.loads(x) for x in jsonl.read_text().splitlines())}
    assert list(records) == names  # streamed in order, one line each
    assert "killed" in records["train_bf16_mixed"]["error"]
    assert "status 7" in records["flex_vs_dense"]["error"]
    assert "status 3 before starting" in records["recompiles"]["error"]
    assert all(records[n]["status"] == "pass" for n in ("env", "doctor"))
    result = gpu_check.summarise(list(records.values()), names, 1.0, False)
    assert result["failed"] == ["train_bf16_mixed", "flex_vs_dense", "recompiles"] and not result["all_ok"]
