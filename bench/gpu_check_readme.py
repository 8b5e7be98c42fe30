"""readme_a100: the README's headline run, `experiment=deepseek7b_6k_a100`, exactly as planned for one A100-80G,
trained on the H200 with the caching allocator capped at what an A100's allocator can get.

The plan is the planner's (flexengine.cli.plan.build_plan: the path `python -m flexengine.plan
experiment=deepseek7b_6k_a100` takes), with random weights and the demo corpus in place of the forum's documents:
the planner reads only shapes. grad_accum is lowered from the README's 8 to GRAD_ACCUM so 1 warm-up + 3 optimizer
steps fit the device call; on one GPU no memory term depends on it (gradients accumulate in place), and the plan is
recomputed for it and must make the README's choices. Those choices (precision, memory policy, micro-batch) and the
plan's CUDA context and margin are pinned as overrides, so the run path plans the very same step on the H200
rather than re-choosing from the H200's own context.

The cap: an A100 gives its allocator the card less the CUDA context (the context lives outside the allocator).
The plan states both (card_bytes, cuda_context_bytes; its budget_bytes is that less the named margin_bytes), so
the cap comes from the plan, never from a figure written here: torch.cuda.set_per_process_memory_fraction(cap /
total_memory) before the check's first allocation. The H200's own context sits outside the fraction, as an A100's
sits outside its card's share. (A planner without a named context: the cap is its budget_bytes, the card.)

Speed: the plan's step time assumes 40 % MFU of the A100's 312 dense bf16 TFLOP/s. The H200 has the H100's tensor
cores (989 TFLOP/s, 3.17x) and 4.8 vs 2.0 TB/s of HBM (2.35x); activation offload crosses PCIe, which neither
speeds up. The expected H200 step is the planner's own step time for the same choices on hardware=h200_141g with
the A100 plan's PCIe bandwidth (PCIe 5.0's 50 GB/s as the faster bound): compute-bound parts 0.32x, memory-bound
parts 0.42x, exposed copies as they are -- and more of them exposed, since 3x faster compute hides less.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from gpu_check_width import (
    FAST_DRY,
    MEMORY_RTOL,
    PROGRESS,
    TIMED_STEPS,
    allocator_mark,
    allocator_since,
    host_empty_cache,
    host_memory_gib,
    progress,
    release_device_memory,
    reserved_verdict,
    run_steps,
)

if TYPE_CHECKING:
    from flexengine.planning.budget import DeviceBudget

GiB = 2**30
README_GRAD_ACCUM = 8  # conf/experiment/deepseek7b_6k_a100.yaml
GRAD_ACCUM = 2  # >= 2: the accumulating micro-batch, whose gradients exist before its backward, is the peak
A100_PEAK_TFLOPS, H200_PEAK_TFLOPS = 312.0, 989.0  # dense bf16 (flexengine.core.hardware.PEAK_BF16_TFLOPS)
A100_HBM_GB_S, H200_HBM_GB_S = 2039.0, 4800.0
PLANNED_MFU = 0.4  # the planner's assumed MFU (planning/costs.py ASSUMED_MFU)
# max_memory_allocated below this share of the plan: the planner over-counts the step (a plan that leaves this
# much of the card unused refuses or offloads jobs that fit). The under-count bound is MEMORY_RTOL.
OVER_COUNT = 0.85
# bytes offload moved per step below this share of the plan's: what the plan offloads did not reach offload's
# hooks (e.g. blocks that ran uncompiled, keeping SAC's cache on the device)
OFFLOAD_SHORT = 0.5
TINY_LAYERS = 4  # the CPU stand-in: the same job and loop at a size whose steps take a second on a shared core
TINY = (
    "++model.arch.vocab_size=2048",  # the demo tokenizer's
    "++model.arch.hidden_size=128",
    "++model.arch.intermediate_size=344",
    "++model.arch.num_attention_heads=4",
    "++model.arch.num_key_value_heads=4",
    f"++model.arch.num_hidden_layers={TINY_LAYERS}",
)


def readme_overrides(grad_accum: int) -> list[str]:
    """The README's command with random weights and the offline demo corpus (what the planner CLI assumes too)."""
    return [
        "experiment=deepseek7b_6k_a100",
        "model.init=random",
        "data=demo",
        "data.demo_max_files=80",
        # the experiment's auto chooses from the corpus (6,144 for the forum's documents): the demo corpus is not
        # theirs, so the check keeps the 8,192-token rows it has always measured
        "data.seq_len=8192",
        f"train.grad_accum={grad_accum}",
        "train.progress=false",
        "train.save_final=false",
    ]


def readme_fit(grad_accum: int, cli: bool = False):
    """The FitPlan of the README's experiment at `grad_accum` on hardware=a100_80g, planned without a card; with
    `cli`, through the planner CLI's own function (its JSON adds the 8-GPU and context reports)."""
    from flexengine.cli.common import compose_job
    from flexengine.cli.plan import build_plan
    from flexengine.resolve import resolve_planned

    run = resolve_planned(compose_job(readme_overrides(grad_accum)))
    return build_plan(run).fit if cli else run.fit


def choices(fit) -> dict:
    """What precision=auto and memory=auto chose: the run must take the same."""
    return {
        "precision": fit.precision.name,
        "memory": dataclasses.asdict(fit.plan.chosen.memory),
        "micro_batch": fit.plan.chosen.micro_batch,
        "policy": fit.plan.chosen.label,
    }


def choice_overrides(fit) -> list[str]:
    """The plan's choices as explicit overrides (kept and checked by the run's planner, not searched again)."""
    mem = fit.plan.chosen.memory
    return [
        f"precision.mode={fit.precision.name}",
        f"memory.policy={mem.policy}",
        f"memory.layers='{mem.layers}'",  # quoted: a list of blocks "0,3,7" is one value, not a sweep
        f"memory.granularity={mem.granularity}",
        f"memory.offload={str(bool(mem.offload)).lower()}",
        f"memory.tiled_mlp={mem.tiled_mlp}",
        f"train.micro_batch={fit.plan.chosen.micro_batch}",
        f"train.grad_accum={fit.plan.chosen.grad_accum}",
    ]


def budget_overrides(budget: DeviceBudget) -> list[str]:
    """The plan's CUDA context and margin as hardware.* overrides, where this engine has them: the run on the H200
    then budgets as the A100 plan did (else it would measure the H200's own context)."""
    from flexengine.core.config import HardwareConfig

    fields = {f.name for f in dataclasses.fields(HardwareConfig)}
    given = {"cuda_context_gb": budget.context_bytes, "memory_margin_gb": budget.margin_bytes}
    return [f"hardware.{k}={v / GiB!r}" for k, v in given.items() if k in fields]


def plan_summary(fit) -> dict:
    """The plan's choices, terms and budget in GiB, and its step time (the numbers the run is held against)."""
    from flexengine.planning.plan import budget_json

    p = fit.plan
    gib = {k.removesuffix("_bytes"): v / GiB for k, v in p.chosen.usage.terms.items()}
    budget = {k: v / GiB for k, v in budget_json(p.chosen.usage.budget).items()}
    return {
        **choices(fit),
        "grad_accum": fit.plan.chosen.grad_accum,
        "terms_gib": gib,
        "total_gib": p.chosen.usage.terms.total_bytes / GiB,
        "allocated_gib": p.chosen.usage.terms.total_bytes / GiB,
        "budget_gib": budget,
        "step_s": p.chosen.time.step_s,
        "offload_gb_per_step": p.chosen.time.offload_bytes_per_step / 1e9,
        "pcie_s_per_step": p.pcie_seconds_per_step,
        "hardware": {k: getattr(fit.hardware, k) for k in ("name", "memory_gb", "peak_tflops", "pcie_gb_s")},
    }


def allocator_cap(budget: DeviceBudget, allocated: int, total_memory: int) -> dict:
    """What an A100's caching allocator can reserve under a plan (its budget and planned allocated peak), as a
    fraction of this device's memory."""
    cap = budget.card_bytes - budget.context_bytes
    basis = "card_bytes - cuda_context_bytes (= budget_bytes + margin_bytes): the A100 card less its context"
    if not 0 < cap <= total_memory:
        raise ValueError(f"cap {cap / GiB:.2f} GiB does not fit this device's {total_memory / GiB:.2f} GiB")
    return {
        "cap_bytes": cap,
        "cap_gib": cap / GiB,
        "basis": basis,
        "device_total_gib": total_memory / GiB,
        "fraction": cap / total_memory,
        "planned_allocated_gib": allocated / GiB,
        "planned_headroom_gib": (cap - allocated) / GiB,
    }


def expected_h200(fit, job_overrides: list[str]) -> dict:
    """The planner's step time for the same choices on an H200 (its peak and HBM; PCIe as the A100 plan assumed,
    and at PCIe 5.0's 50 GB/s), against the A100 plan's, with the pure compute and bandwidth ratios."""
    from flexengine.cli.common import compose_job
    from flexengine.resolve import resolve_planned

    steps = {}
    for pcie in (fit.hardware.pcie_gb_s, 50.0):
        job = compose_job([*job_overrides, "hardware=h200_141g", f"hardware.pcie_gb_s={pcie}"])
        steps[pcie] = resolve_planned(job).plan.chosen.time.step_s
    a100 = fit.plan.chosen.time.step_s
    return {
        "a100_plan_step_s": a100,
        "h200_step_s": steps[fit.hardware.pcie_gb_s],
        "h200_step_s_pcie5": steps[50.0],
        "ratio": steps[fit.hardware.pcie_gb_s] / a100,
        "ratio_pcie5": steps[50.0] / a100,
        "compute_ratio": A100_PEAK_TFLOPS / H200_PEAK_TFLOPS,
        "hbm_ratio": A100_HBM_GB_S / H200_HBM_GB_S,
        "why": (
            "H200 = H100 tensor cores (989 vs 312 dense bf16 TFLOP/s) and 4.8 vs 2.0 TB/s HBM: compute-bound parts "
            "scale 0.32x, memory-bound 0.42x; activation offload is PCIe-bound and does not scale (and 3x faster "
            "compute hides less of it); at the same 40 % MFU"
        ),
    }


def run_capped(overrides: list[str], cap: dict, steps: int) -> dict:
    """run_steps under set_per_process_memory_fraction(cap), set before the check's first allocation; an OOM is
    a result (with how far the run got), not a crash. The fraction is lifted and the memory freed afterwards."""
    reserved_before = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction(cap["fraction"])
    progress(f"allocator capped at {cap['cap_gib']:.2f} GiB ({cap['fraction']:.4f} of the device)")
    mark = allocator_mark()
    try:
        run = {"oom": False, **run_steps(overrides, steps)}
    except Exception as e:  # an OOM inside a compile (autotuning, a graph's first run) comes wrapped
        counters = allocator_since(mark)
        if not (isinstance(e, torch.OutOfMemoryError) or counters["ooms"] or "out of memory" in str(e).lower()):
            raise
        run = {"oom": True, "error": f"{type(e).__name__}: {e}"[:1500], "reached": PROGRESS[-1] if PROGRESS else "-"}
        run |= counters
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    run["reserved_before_bytes"] = reserved_before
    run["max_reserved_total_gib"] = torch.cuda.max_memory_reserved() / GiB
    release_device_memory()
    return run


def pcie_bandwidth(nbytes: int = GiB) -> dict:
    """Pinned host <-> device copy bandwidth, `nbytes` each way (after one warm-up copy), in GB/s: what the plan's
    offload time assumes (hardware.pcie_gb_s). The buffers are freed, and the pinned block handed back."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {"bytes": nbytes}
    for name, dst, src in (("h2d", device, host), ("d2h", host, device)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out[f"{name}_gb_s"] = nbytes / (start.elapsed_time(end) / 1e3) / 1e9
    del host, device
    torch.cuda.empty_cache()
    host_empty_cache()
    return out


def offload_report(run: dict) -> dict | None:
    """Offload's traffic in the timed steps against the plan's: bytes to the host and back per step (the plan
    counts both ways over every micro-batch), the most pinned bytes held (the host allocator's rounded blocks)
    against the plan's pinned bound, and bytes that went to pageable memory. None without offload."""
    steps = run.get("offload") or []
    timed = steps[1:] or steps
    if not timed:
        return None
    moved = sum(s["to_host_bytes"] + s["to_device_bytes"] for s in timed) / len(timed)
    planned = run["planned_offload_bytes_per_step"]
    return {
        "per_step": steps,
        "moved_gb_per_step": moved / 1e9,
        "planned_gb_per_step": planned / 1e9,
        "moved_over_plan": _over(moved, planned),
        "to_host_gb_per_step": sum(s["to_host_bytes"] for s in timed) / len(timed) / 1e9,
        "max_pinned_gib": max(s["max_pinned_seen"] for s in steps) / GiB,
        "planned_pinned_bound_gib": _gib(run["planned_pinned_bound_bytes"]),
        "planned_offloaded_gib_per_micro_batch": run["planned_offloaded_bytes"] / GiB,
        "pageable_gib": sum(s["pageable_bytes"] for s in steps) / GiB,
    }


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GiB


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def memory_report(run: dict, cap: dict) -> dict:
    """The run's memory against its plan: allocated and reserved peaks, what stays between steps (weights and
    optimizer states) and what comes and goes within one (gradients, activations, workspaces), retries, OOM."""
    terms = run["planned_terms"]
    static = terms["weights_bytes"] + terms["optimizer_bytes"]
    peak, between, reserved = run["measured_device_bytes"], run["between_steps_bytes"], run["max_reserved_bytes"]
    dynamic = None if between is None else peak - between
    return {
        "oom": run.get("oom", False),
        "alloc_retries": run["alloc_retries"],
        "max_reserved_gib": _gib(reserved),
        "cap_gib": cap["cap_gib"],
        "reserved_headroom_gib": None if reserved is None else cap["cap_gib"] - reserved / GiB,
        "max_allocated_gib": _gib(peak),
        "planned_allocated_gib": run["planned_device_bytes"] / GiB,
        "allocated_over_plan": _over(peak, run["planned_device_bytes"]),
        "between_steps_gib": _gib(between),
        "planned_static_gib": static / GiB,  # weights + optimizer states
        "static_over_plan": _over(between, static),
        "within_step_gib": _gib(dynamic),
        "planned_within_step_gib": (run["planned_device_bytes"] - static) / GiB,  # grads, activations, workspaces
        "planned_activation_gib": terms["activation_bytes"] / GiB,
        "within_step_over_plan": _over(dynamic, run["planned_device_bytes"] - static),
        "reserved": reserved_verdict(run),
    }


def speed_report(run: dict, expected: dict) -> dict:
    """The measured step and MFU against the A100 plan's and the H200's expected step (expected_h200)."""
    return {
        "step_s": run["step_s"],
        "a100_plan_step_s": run["planned_step_s"],
        "expected_h200_step_s": expected["h200_step_s"],
        "expected_h200_step_s_pcie5": expected["h200_step_s_pcie5"],
        "step_over_expected": run["step_s"] / expected["h200_step_s"],
        "step_over_a100_plan": run["step_s"] / run["planned_step_s"],
        "mfu": run["mfu"],  # against this device's own peak (989 on the H200)
        "planned_mfu": PLANNED_MFU,
        "mfu_over_assumed": run["mfu"] / PLANNED_MFU,
        "expected_ratio": expected,
    }


def problems_of(run: dict, memory: dict, offload: dict | None = None) -> list[str]:
    """What fails the check: an OOM, a non-finite step, cudaMalloc retries, an allocated peak over the plan by
    more than MEMORY_RTOL (an under-count) or under OVER_COUNT of it (an over-count), a reserved peak past the
    plan's margin (reserved_verdict), a block that must run compiled and did not, and (on a GPU) offload moving
    under OFFLOAD_SHORT of the plan's bytes."""
    if run.get("oom"):
        return [f"out of memory at {memory['cap_gib']:.2f} GiB, after: {run['reached']}"]
    problems = [] if run["finite"] else ["a non-finite loss or grad norm"]
    over = memory["allocated_over_plan"]
    if over is not None and over > 1 + MEMORY_RTOL:
        problems.append(f"max_memory_allocated {over:.3f}x the plan: the planner under-counts this step")
    if over is not None and over < OVER_COUNT:
        problems.append(f"max_memory_allocated {over:.3f}x the plan: the planner over-counts this step")
    compiled = run.get("compile") or {}
    if compiled.get("must_compile") and compiled.get("skipped_blocks"):
        problems.append(f"{compiled['skipped_blocks']} blocks ran uncompiled: {compiled['skip_reason']}")
    short = None if offload is None else offload["moved_over_plan"]
    if torch.cuda.is_available() and short is not None and short < OFFLOAD_SHORT:
        problems.append(f"offload moved {short:.2f}x the plan's bytes per step: what SAC keeps missed its hooks")
    return problems + memory["reserved"]["problems"]


def replans_the_same(pinned: list[str], fit) -> dict:
    """The run path's planner on the pinned job (explicit choices, no search), without a card: the same step?"""
    from flexengine.cli.common import compose_job
    from flexengine.resolve import resolve_planned

    again = resolve_planned(compose_job(pinned)).fit
    same = (
        choices(again) == choices(fit)
        and abs(again.plan.chosen.usage.terms.total_bytes - fit.plan.chosen.usage.terms.total_bytes) < 2**20
    )
    return {
        "same": same,
        "total_gib": again.plan.chosen.usage.terms.total_bytes / GiB,
        "policy": again.plan.chosen.label,
    }


def model_on_meta(pinned: list[str], fit) -> dict:
    """The run's own model constructor (surgery.model.load_model: random weights built on the given device, never
    on the CPU first) at full depth and 7B width on the meta device: its parameters against the plan's weights."""
    from flexengine.cli.common import compose_job
    from flexengine.surgery.model import load_model

    job = compose_job(pinned)
    model = load_model(job.model, torch.device("meta"), fit.precision.param_dtype)
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    return {
        "layers": model.config.num_hidden_layers,
        "params": sum(p.numel() for p in params),
        "built_on_meta": all(p.device.type == "meta" for p in params),
        "weights_gib": weights / GiB,
        "equals_plan_weights": weights == fit.plan.chosen.usage.terms.weights_bytes,
    }


def cpu_overrides(pinned: list[str], layers: str, depth: int) -> list[str]:
    """The pinned job on the CPU at TINY's size, its checkpointed blocks scaled to TINY_LAYERS of `depth` (both
    kinds of block stay: spread_26 of 30 -> spread_3 of 4); varlen (CPU flex has no backward), eager (the
    recompiles check compiles SAC blocks on the CPU); no card, so no context or margin to pin."""
    keep = [o for o in pinned if not o.startswith(("hardware.cuda_context_gb", "hardware.memory_margin_gb"))]
    cpu = ["hardware=cpu", "data.seq_len=512", "data.demo_max_files=24", "attn.backend=varlen", "train.compile=false"]
    return [*keep, *TINY, *cpu, f"memory.layers='{scaled_layers(layers, depth, TINY_LAYERS)}'"]


def scaled_layers(layers: str, depth: int, to: int) -> str:
    """memory.layers of a `depth`-block model for a `to`-block one: spread_k / first_k / last_k keep their share
    of blocks (at least one, and one left out when the original left some out); all, every_n and lists pass."""
    kind, _, k = layers.rpartition("_")
    if kind not in ("spread", "first", "last") or not k.isdigit():
        return layers
    share = max(1, round(int(k) * to / depth))
    return f"{kind}_{min(share, to - 1) if int(k) < depth else to}"


def _device_total_memory(dry: bool) -> int:
    """This GPU's memory as torch reports it; in the dry run, the H200's (conf/hardware/h200_141g.yaml)."""
    if not dry:
        return torch.cuda.get_device_properties(0).total_memory
    from flexengine.cli.common import compose_job

    return int(compose_job(["hardware=h200_141g"]).hardware.memory_gb * GiB)


def check_readme_a100(dry: bool) -> dict:
    """The README's plan at the A100's budget through the real loop (dry: the plan, the pinned job's re-plan,
    the model on meta, the cap arithmetic, and the same job at a tiny width through the loop on the CPU)."""
    readme = readme_fit(README_GRAD_ACCUM, cli=True)
    fit = readme_fit(GRAD_ACCUM)
    job = [*readme_overrides(GRAD_ACCUM), *choice_overrides(fit)]
    pinned = [*job, *budget_overrides(fit.plan.chosen.usage.budget)]
    cap = allocator_cap(
        fit.plan.chosen.usage.budget, fit.plan.chosen.usage.terms.total_bytes, _device_total_memory(dry)
    )
    progress(f"planned: precision={fit.precision.name}, {fit.plan.chosen.label}, cap {cap['cap_gib']:.2f} GiB")
    record = {
        "readme_plan": plan_summary(readme),
        "plan": plan_summary(fit),
        "same_choices_as_readme": choices(fit) == choices(readme),
        "pinned_overrides": pinned,
        "replanned": replans_the_same(pinned, fit),
        "cap": cap,
        "expected_h200": expected_h200(fit, job),
        "host_memory_gib": host_memory_gib(),
    }
    problems = [] if record["same_choices_as_readme"] else [f"grad_accum={GRAD_ACCUM} changes the README's choices"]
    problems += [] if record["replanned"]["same"] else ["the pinned overrides do not reproduce the plan"]
    if dry:
        meta = record["model_on_meta"] = model_on_meta(pinned, fit)
        progress(f"model on meta: {meta['params'] / 1e9:.2f}B parameters")
        problems += [] if meta["built_on_meta"] and meta["equals_plan_weights"] else ["model != the plan's weights"]
        if FAST_DRY[0]:  # the CI's fast dry run: the plan, the pinning, the model and the cap; no CPU steps
            return _verdict(record, problems, headline_of(record, dry))
    if dry:
        layers = cpu_overrides(pinned, fit.plan.chosen.memory.layers, fit.plan.n_layers)
        run = record["run"] = run_steps(layers, steps=1)
    else:
        pcie = record["pcie"] = pcie_bandwidth()
        progress(f"PCIe pinned: {pcie.get('h2d_gb_s', 0):.1f} GB/s h2d, {pcie.get('d2h_gb_s', 0):.1f} d2h")
        run = record["run"] = run_capped(pinned, cap, TIMED_STEPS)
        host_empty_cache()  # offload's pinned blocks, before the next check
    if run.get("oom"):
        problems += problems_of(run, {"cap_gib": cap["cap_gib"]})
        return _verdict(record, problems, {"oom": True, "reached": run["reached"], "cap_gib": cap["cap_gib"]})
    record["compile"] = run["compile"]
    record["memory"] = memory_report(run, cap)
    record["offload"] = offload_report(run)
    record["speed"] = speed_report(run, record["expected_h200"])
    problems += problems_of(run, record["memory"], record["offload"])
    return _verdict(record, problems, headline_of(record, dry))


def _verdict(record: dict, problems: list[str], headline: dict) -> dict:
    out = {"ok": not problems, **record, "headline": headline}
    return {**out, "error": "; ".join(problems)} if problems else out


def headline_of(record: dict, dry: bool) -> dict:
    """The check's key numbers: the plan and the cap (dry), or the run against them (GPU)."""
    if dry:
        out = {
            "precision": record["plan"]["precision"],
            "policy": record["plan"]["policy"],
            "planned_gib": record["plan"]["allocated_gib"],
            "cap_gib": record["cap"]["cap_gib"],
            "expected_h200_step_s": record["expected_h200"]["h200_step_s"],
        }
        if "compile" in record:  # the CPU steps ran (not --fast)
            out["skipped_blocks"] = record["compile"]["skipped_blocks"]
            out["allocated_over_plan"] = record["memory"]["allocated_over_plan"]
            out["offload_over_plan"] = (record["offload"] or {}).get("moved_over_plan")
        return out
    memory, speed = record["memory"], record["speed"]
    return {
        "oom": memory["oom"],
        "retries": memory["alloc_retries"],
        "reserved_gib": memory["max_reserved_gib"],
        "cap_gib": memory["cap_gib"],
        "allocated_over_plan": memory["allocated_over_plan"],
        "skipped_blocks": record["compile"]["skipped_blocks"],
        "offload_over_plan": (record["offload"] or {}).get("moved_over_plan"),
        "step_s": speed["step_s"],
        "expected_step_s": speed["expected_h200_step_s"],
        "mfu": speed["mfu"],
    }
