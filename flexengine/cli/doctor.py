"""`python -m flexengine.doctor <train overrides>`: run a few real training steps and explain a slow run.

The doctor is a client of the trainer: it builds the run exactly like training (`build_planned_trainer`), registers
`StepHooks` (the trainer's own callbacks: step start/end and the time of each phase), counts what dynamo
compiled (`flexengine.surgery.compile.CompileWatch`), and takes memory from the planner -- the same bytes model that
chose the run's policy -- checked against the allocator's peak on CUDA. It patches nothing and runs no
dispatch mode around compiled code, so it works with flex and compiled blocks. It turns the numbers into
verdicts and concrete suggestions, prints a report and writes doctor.json. Nothing here changes how training runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import torch

from flexengine.cli.common import compose_job, fail, quiet_third_party
from flexengine.cli.doctor_time import PHASES, epoch_check, step_time_check, step_time_numbers, verdict_row
from flexengine.core.config import JobConfig
from flexengine.core.errors import UserError
from flexengine.core.storage import write_json_atomic
from flexengine.core.units import GiB
from flexengine.loop.hooks import PHASES as STEP_PHASES
from flexengine.loop.hooks import StepHooks
from flexengine.loop.metrics import allocator_stats, utilization
from flexengine.planning.budget import reserved_limit_bytes
from flexengine.planning.planner import evaluate, plan_memory
from flexengine.planning.shapes import ModelShape
from flexengine.surgery.applied import applied
from flexengine.surgery.attention.job_rules import packs_documents
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.compile import CompileWatch

log = logging.getLogger(__name__)


class DoctorHooks(StepHooks):
    """Collects each step's phase times and metrics through the trainer's callbacks."""

    timed = True

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._phases: dict = defaultdict(float)
        self._t0 = 0.0

    def on_step_start(self, trainer, step: int) -> None:
        trainer.sync_device()
        self._phases.clear()
        self._t0 = time.perf_counter()

    def on_phase(self, trainer, name: str, seconds: float) -> None:
        self._phases[name] += seconds

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        trainer.sync_device()
        total = time.perf_counter() - self._t0
        phases = {p: self._phases.get(p, 0.0) for p in STEP_PHASES}
        phases["other"] = max(0.0, total - sum(phases.values()))
        self.steps.append({**metrics, "time_s": total, "phases": phases})


# -- memory -----------------------------------------------------------------------------------------------
def memory_report(trainer, run, allocator: dict) -> dict:
    """The planner's bytes for the policy this run applied and for the planner's own choice; on CUDA also what the
    caching allocator held over the diagnosed steps (flexengine.loop.metrics.allocator_stats; None on CPU). run:
    the ResolvedRun the trainer was built with (flexengine.run.build_planned_trainer)."""
    model = trainer.model
    x, current = run.inputs(), run.job.memory  # what build_planned_trainer resolved and applied
    now = evaluate(ModelShape.from_hf_config(model.config), x, current)
    plan = plan_memory(model.config, x)
    specs = applied(model).memory
    return {
        "policy": asdict(current),
        "blocks_changed": [i for i, s in enumerate(specs) if s.changes_block],
        "block_specs": [s.describe() for s in specs],
        "n_layers": len(specs),
        "planned_total_bytes": now.usage.terms.total_bytes,
        "budget_bytes": now.usage.budget.usable_bytes,
        "margin_bytes": now.usage.budget.margin_bytes,
        "fits": now.usage.fits,
        "recompute_flops_fraction": now.time.recompute_flops_fraction,
        "cost": now.time.cost,
        "activation_bytes_per_block": list(now.usage.activation_bytes_per_block),
        "planner_choice": {
            "policy": plan.chosen.label,
            "memory": asdict(plan.chosen.memory),
            "fits": plan.chosen.usage.fits,
            "total_bytes": plan.chosen.usage.terms.total_bytes,
            "recompute_flops_fraction": plan.chosen.time.recompute_flops_fraction,
            "cost": plan.chosen.time.cost,
            "suggestions": list(plan.suggestions),
        },
        "measured_peak_bytes": allocator["max_memory_allocated_bytes"],  # over the measured steps (None on CPU)
        # peaks over the measured steps; the retry and OOM counters over the whole run, warm-up included
        "allocator": allocator,
        # the allocator's settings in force (the CUDA name, else the generic one torch also reads)
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF")),
    }


# -- the run ------------------------------------------------------------------------------------------------
def diagnose(job: JobConfig, out_dir: Path, steps: int = 4, warmup: int = 1, built=None) -> dict:
    """Run warmup + steps optimizer steps with the doctor's hooks; returns the report (also doctor.json). built:
    (trainer, ResolvedRun) from flexengine.run.build_planned_trainer (None: built here from `job`)."""
    from flexengine.run import build_planned_trainer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    job.train.progress = False
    trainer, run = built if built is not None else build_planned_trainer(job, out_dir)
    hooks = DoctorHooks()
    trainer.add_hooks(hooks)
    trainer.model.train()
    compiles = {}
    watch = CompileWatch()
    try:
        for i in range(warmup + steps):
            if i == warmup:
                compiles["warmup"] = watch.stats()
                watch.start()
                if trainer.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(trainer.device)
            trainer.train_step()
        compiles["measured"] = watch.stats()
    finally:
        trainer.hooks.remove(hooks)
    compiles.setdefault("warmup", compiles["measured"])
    for i, step in enumerate(hooks.steps):
        step["warmup"] = i < warmup
    memory = memory_report(trainer, run, allocator_stats(trainer.device))
    trained = replace(run.job, train=trainer.setup.train)  # train.epochs became max_steps in the data stage
    report = build_report(trainer, trained, hooks.steps, compiles, memory)
    write_json_atomic(out_dir / "doctor.json", report)
    trainer.metrics.close()
    return report


def build_report(trainer, job: JobConfig, per_step: list, compiles: dict, memory: dict) -> dict:
    """Numbers -> checks (verdict ok / info / warn / bad, with details) -> suggestions; job: the one that trains."""
    device, spec = trainer.device, trainer.attn
    measured = [s for s in per_step if not s["warmup"]] or per_step
    wall = sum(s["time_s"] for s in measured)
    tokens, useful = sum(s["tokens"] for s in measured), sum(s["useful_tokens"] for s in measured)
    phase_s = {p: sum(s["phases"][p] for s in measured) for p in PHASES}
    sparsity = [s["block_density"] for s in measured if s["block_density"] is not None]
    warm, steady = compiles["warmup"], compiles["measured"]
    numbers = {
        "device": str(device),
        "attention": spec.as_dict(),
        "attn_mode": job.attn.mode,
        "attn_backend": spec.backend.value,
        "attn_backend_requested": job.attn.backend,
        "attn_compile": job.attn.compile,
        "compile_backend": applied(trainer.model).compile_backend,
        "steps_measured": len(measured),
        "graphs_compiled_warmup": warm.graphs,
        "recompiles_warmup": warm.recompiles,
        "graphs_compiled_after_warmup": steady.graphs,
        "recompiles_after_warmup": steady.recompiles,
        "recompile_reasons": warm.reasons + steady.reasons,
        "graph_breaks": warm.graph_breaks + steady.graph_breaks,
        "useful_token_fraction": useful / max(1, tokens),
        "padding_waste": 1 - useful / max(1, tokens),
        "block_density": sum(sparsity) / len(sparsity) if sparsity else None,
        "step_s": wall / len(measured),
        "tokens_per_s": tokens / wall,
        "useful_tokens_per_s": useful / wall,
        "mfu": utilization(sum(s["model_flops"] for s in measured), wall, job.hardware.peak_tflops),
        "hfu": utilization(sum(s["hardware_flops"] for s in measured), wall, job.hardware.peak_tflops),
        "peak_tflops": job.hardware.peak_tflops,
        "time_split": {p: phase_s[p] / wall for p in PHASES},
        "step_time": step_time_numbers(trainer, measured),
        "memory": memory,
        "losses": [s["loss"] for s in per_step],
    }
    checks = [check(job, numbers) for check in CHECKS]  # one verdict per question a slow run raises
    return {
        "numbers": numbers,
        "checks": checks,
        "suggestions": [c["suggestion"] for c in checks if c.get("suggestion")],
        "config": asdict(job),
    }


def attention_check(job: JobConfig, n: dict) -> dict:
    """The attention backend: what ran, and why."""
    backend, mode = AttnBackend(n["attn_backend"]), n["attn_mode"]
    if backend is AttnBackend.HF_SDPA:
        # the padding it costs is judged (and the fix suggested) by the useful-tokens check below
        return verdict_row(
            "attention",
            "info",
            f"HF sdpa ({mode}), one document per row",
            "the padded baseline: every row is padded to the batch's longest document",
        )
    if backend is AttnBackend.DENSE and n["device"].startswith("cuda"):
        return verdict_row(
            "attention",
            "warn",
            f"dense ({mode})",
            "materialises a [B, 1, S, S] mask per batch",
            "dense attention masks on GPU: use attn.backend=flex (or auto)",
        )
    if backend is AttnBackend.FLEX and not job.attn.compile:
        return verdict_row(
            "attention",
            "warn",
            f"flex ({mode}), not compiled",
            "uncompiled flex materialises scores",
            "FlexAttention runs uncompiled: set attn.compile=true",
        )
    why = {
        AttnBackend.VARLEN: "auto picks per-document SDPA on CPU (FlexAttention has no CPU backward)",
        AttnBackend.DENSE: "the boolean-mask reference (attn.backend=auto runs varlen: same result, SDPA's "
        "causal cost)",
    }.get(backend, "")
    return verdict_row("attention", "ok", f"{backend.value} ({mode})", why)


def compile_check(job: JobConfig, n: dict) -> dict:
    """Compilation: graphs compiled or broken after warm-up, or blocks left eager on a GPU."""
    new_graphs, recompiles, breaks = n["graphs_compiled_after_warmup"], n["recompiles_after_warmup"], n["graph_breaks"]
    if new_graphs or breaks:
        reasons = "; ".join(n["recompile_reasons"][:3])
        return verdict_row(
            "compile",
            "warn",
            f"{new_graphs} graphs compiled after warm-up ({recompiles} recompiles), {breaks} graph breaks",
            "each recompile stalls a step; each graph break splits a block's graph"
            + (f"; guards that failed: {reasons}" if reasons else ""),
            "keep shapes fixed (pack every row to data.seq_len) and look at TORCH_LOGS=recompiles,graph_breaks",
        )
    if n["device"].startswith("cuda") and not job.train.compile:
        return verdict_row(
            "compile", "warn", "decoder blocks run eagerly", "", "compile the decoder blocks: train.compile=true"
        )
    return verdict_row("compile", "ok", f"{n['graphs_compiled_warmup']} graphs compiled in warm-up, none after it")


def useful_tokens_check(job: JobConfig, n: dict) -> dict:
    """Data: the share of computed tokens that are padding."""
    frac = n["useful_token_fraction"]
    verdict = "ok" if frac >= 0.9 else ("warn" if frac >= 0.6 else "bad")
    suggestion = (
        ""
        if verdict == "ok"
        else (
            f"{n['padding_waste']:.0%} of the tokens computed are padding: "
            + (
                "enable attn=packed_doc (packs documents with per-document masks)"
                if not packs_documents(job.attn.mode)
                else "use data.packing=bfd, or a data.seq_len closer to your document lengths"
            )
        )
    )
    return verdict_row("useful tokens", verdict, f"{frac:.1%} useful, {n['padding_waste']:.1%} padding", "", suggestion)


def block_density_check(job: JobConfig, n: dict) -> dict:
    """How much of a causal mask's block grid the attention really computed."""
    sp = n["block_density"]
    return verdict_row(
        "block density",
        "info",
        "n/a (HF attention)" if sp is None else f"{sp:.1%} of causal blocks",
        "share of a causal mask's attention blocks actually computed (lower = more skipped)",
    )


def time_split_check(job: JobConfig, n: dict) -> dict:
    """Where the step's time goes; data loading and mask building should be small."""
    split = n["time_split"]
    verdict = "warn" if split["data"] + split["mask"] > 0.2 else "ok"
    return verdict_row(
        "time split",
        verdict,
        ", ".join(f"{p} {split[p]:.0%}" for p in PHASES),
        "",
        ""
        if verdict == "ok"
        else "data loading / mask building takes over 20% of the step: "
        "raise train.micro_batch or check data.num_workers and the mask backend",
    )


def throughput_check(job: JobConfig, n: dict) -> dict:
    """Tokens per second and MFU / HFU against the hardware's peak."""
    mfu, hfu = n["mfu"], n["hfu"]
    verdict = "warn" if n["device"].startswith("cuda") and mfu is not None and mfu < 0.2 else "info"
    util = (
        "MFU n/a (unknown peak)"
        if mfu is None
        else f"MFU {mfu:.1%} (hardware FLOPs {hfu:.1%}) of {n['peak_tflops']} TFLOP/s"
    )
    return verdict_row(
        "throughput",
        verdict,
        f"{n['tokens_per_s']:.0f} tokens/s, {n['useful_tokens_per_s']:.0f} useful/s, " + util,
        "MFU: model FLOPs of useful tokens and attended pairs; hardware FLOPs add "
        "padding, recompute and attention as the backend runs it (flexengine.loop.flops)",
        "" if verdict != "warn" else "MFU under 20%: see the time split and the suggestions above",
    )


def memory_check(job: JobConfig, n: dict) -> dict:
    """The planner's verdict on the applied policy: does it fit, and does it recompute more than needed?"""
    mem = n["memory"]
    choice = mem["planner_choice"]
    value = (
        f"{mem['planned_total_bytes'] / GiB:.3g} of {mem['budget_bytes'] / GiB:.3g} GiB planned "
        f"({mem['policy']['policy']}, {len(mem['blocks_changed'])} of {mem['n_layers']} blocks changed, "
        f"recompute {mem['recompute_flops_fraction']:.0%} of step FLOPs)"
    )
    detail = f"planner's choice: {choice['policy']} ({choice['total_bytes'] / GiB:.3g} GiB)"
    if mem["measured_peak_bytes"] is not None:
        detail += f"; allocator peak {mem['measured_peak_bytes'] / GiB:.3g} GiB"
    if not mem["fits"]:
        fix = (
            f"the planner's choice fits: memory=auto (it picks {choice['policy']!r})"
            if choice["fits"]
            else "nothing fits as configured: " + "; ".join(choice["suggestions"])
        )
        needs = f"this policy needs more than hardware.memory_gb={job.hardware.memory_gb}: {fix}"
        return verdict_row("memory", "bad", value, detail, needs)
    if choice["fits"] and mem["cost"] > choice["cost"] + 1e-6:
        return verdict_row(
            "memory",
            "warn",
            value,
            detail,
            f"memory=auto fits with less recompute (it picks {choice['policy']!r}: recompute "
            f"{choice['recompute_flops_fraction']:.0%} instead of {mem['recompute_flops_fraction']:.0%})",
        )
    return verdict_row("memory", "ok", value, detail)


def _allocator_fixes(job: JobConfig, mem: dict) -> str:
    """The knobs that lower what the allocator must hold, or leave it more of the card."""
    now = f"{mem['policy']['policy']}, {len(mem['blocks_changed'])} of {mem['n_layers']} blocks changed"
    fixes = [
        f"recompute more: memory.policy=full, or more blocks in memory.layers (now {now})",
        f"a smaller train.micro_batch (now {job.train.micro_batch}; raise train.grad_accum to keep the batch)",
        "a larger fragmentation margin in the plan: hardware.memory_margin_gb",
    ]
    if "expandable_segments:True" not in (mem["cuda_alloc_conf"] or ""):
        fixes.insert(0, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the allocator fragments less)")
    return "; ".join(fixes)


def allocator_check(job: JobConfig, n: dict) -> dict:
    """What the CUDA caching allocator really held: out-of-memory errors, cudaMalloc retries (each one frees the
    cache and synchronises the device: a stall), or a reserved peak past the planned peak plus the plan's margin
    (the margin was too small: planning.budget.reserved_limit_bytes)."""
    mem = n["memory"]
    a = mem["allocator"]
    if a["max_memory_reserved_bytes"] is None:
        return verdict_row("allocator", "info", "n/a (no CUDA caching allocator on CPU)")
    reserved = a["max_memory_reserved_bytes"]
    limit = reserved_limit_bytes(mem["planned_total_bytes"], mem["margin_bytes"])
    value = (
        f"{reserved / GiB:.3g} GiB reserved of {limit / GiB:.3g} GiB (planned peak + margin; allocated "
        f"{a['max_memory_allocated_bytes'] / GiB:.3g}, overhead {a['allocator_overhead_bytes'] / GiB:.3g}), "
        f"{a['num_alloc_retries']} retries, {a['num_ooms']} OOMs"
    )
    problems = []
    if a["num_ooms"]:
        problems.append(f"the allocator ran out of memory {a['num_ooms']} time(s)")
    if a["num_alloc_retries"]:
        problems.append(f"cudaMalloc failed and was retried after freeing the cache {a['num_alloc_retries']} time(s)")
    if reserved > limit:
        problems.append(
            f"the allocator reserved {(reserved - limit) / GiB:.2f} GiB beyond the planned peak plus the plan's "
            "margin: fragmentation and workspaces outgrew the margin"
        )
    if not problems:
        return verdict_row("allocator", "ok", value, "reserved peak within the planned peak plus margin, no retries")
    verdict = "bad" if a["num_ooms"] else "warn"
    return verdict_row(
        "allocator", verdict, value, "; ".join(problems), "leave the allocator room: " + _allocator_fixes(job, mem)
    )


# The checks in report order: each takes the job and the numbers and returns one verdict (a warn/bad one carries a
# concrete suggestion).
CHECKS = (
    attention_check,
    compile_check,
    useful_tokens_check,
    block_density_check,
    time_split_check,
    throughput_check,
    step_time_check,
    epoch_check,
    memory_check,
    allocator_check,
)


# -- output -------------------------------------------------------------------------------------------------
MARKS = {"ok": "OK  ", "info": "INFO", "warn": "WARN", "bad": "BAD "}


def format_report(report: dict) -> str:
    """The report as plain text: one line per check, then the suggestions."""
    lines = ["flexengine doctor", "=" * 17]
    for c in report["checks"]:
        lines.append(f"[{MARKS[c['verdict']]}] {c['name']:<22} {c['value']}")
        if c["detail"]:
            lines.append(f"{'':29}{c['detail']}")
    lines.append("")
    lines.append("suggestions:" if report["suggestions"] else "suggestions: none, this run looks healthy")
    lines.extend(f"  - {s}" for s in report["suggestions"])
    return "\n".join(lines)


def run_doctor(argv: Optional[list[str]] = None) -> dict:
    """Parse --steps/--out, compose the overrides, diagnose, print, write doctor.json; returns the report."""
    parser = argparse.ArgumentParser(prog="python -m flexengine.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="the same overrides as python -m flexengine.train")
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps (after 1 warm-up step)")
    parser.add_argument(
        "--out", type=Path, default=None, help="output dir (default train.output_dir or outputs/doctor/<time>)"
    )
    args = parser.parse_args(argv)
    quiet_third_party()
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        job = compose_job(args.overrides)
        out = args.out or Path(job.train.output_dir or Path("outputs/doctor") / time.strftime("%Y-%m-%d/%H-%M-%S"))
        report = diagnose(job, out, steps=args.steps)
    except UserError as e:
        fail(e)
    print(format_report(report))
    print(f"\nwritten: {out / 'doctor.json'}")
    return report


def exit_status(report: dict) -> int:
    """0 when no check failed; 1 when one did (verdict bad: the run does not fit, or wastes most of its tokens)."""
    return int(any(c["verdict"] == "bad" for c in report["checks"]))


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point (`flexengine-doctor`): the report on stdout, exit status 0, or 1 on a failed check.
    (Returning the report would hand it to sys.exit, which prints the dict and exits 1.)"""
    sys.exit(exit_status(run_doctor(argv)))


if __name__ == "__main__":
    main()
