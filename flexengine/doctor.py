"""`python -m flexengine.doctor <train overrides>`: run a few real training steps and explain a slow run.

Builds the run exactly like training (`build_trainer`), instruments the trainer's own step from outside (data /
mask / forward / backward / optimizer timers, tokenizer call counter, dynamo counters), measures the activation
bytes one decoder block saves for backward, and turns the numbers into verdicts and concrete suggestions.
Prints a report and writes doctor.json into the output directory. Nothing here changes how training runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from flexengine.attention import MASK_KWARG, AttnBackend
from flexengine.checkpoint import write_json_atomic
from flexengine.config import JobConfig
from flexengine.errors import UserError
from flexengine.memory import decoder_layers

log = logging.getLogger(__name__)

PHASES = ("data", "mask", "forward", "backward", "optimizer", "other")
MEMORY_HEADROOM = 0.9  # plan into 90 % of hardware.memory_gb: allocator fragmentation, CUDA context, spikes


def compose_job(overrides: list[str]) -> JobConfig:
    """Compose conf/ with the same overrides `python -m flexengine.train` takes, into a validated JobConfig."""
    from hydra import compose, initialize_config_module

    from flexengine.train import to_job_config  # registers the dataclass schema with Hydra's ConfigStore

    with initialize_config_module(version_base="1.3", config_module="flexengine.conf"):
        return to_job_config(compose("config", overrides=list(overrides)))


# -- instrumentation --------------------------------------------------------------------------------------
@contextlib.contextmanager
def _patched(owner: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace owner.name by make(original) for the duration; restores exactly (also inherited attributes)."""
    had_own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


class StepProbe:
    """Timers and counters around one Trainer's step, installed by `attach` and removed on exit."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict = defaultdict(float)  # phase -> seconds (current step)
        self.tokenizer_calls = 0
        self.mask_backends: Counter = Counter()
        self.block_inputs: Optional[tuple] = None  # (args, kwargs) of decoder block 0, for the memory probe
        self.forward_inputs: Optional[tuple] = None  # (batch, mask kwargs) of the first forward, likewise

    def sync(self) -> None:
        """Wait for queued GPU work so wall-clock timers measure it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, phase: str, fn: Callable) -> Callable:
        """fn, with its wall time (GPU work included) added to `phase`."""

        def wrapper(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.times[phase] += time.perf_counter() - t0
            return out

        return wrapper

    @contextlib.contextmanager
    def attach(self, trainer) -> Iterator["StepProbe"]:
        """Instrument `trainer` (its loader, mask builder, forward, backward, optimizer and tokenizer)."""
        probe = self

        def count_calls(fn):
            def wrapper(*args, **kwargs):
                probe.tokenizer_calls += 1
                return fn(*args, **kwargs)
            return wrapper

        def record_mask(fn):
            def wrapper(batch):
                kwargs = fn(batch)
                mask = kwargs.get(MASK_KWARG)
                probe.mask_backends[mask.spec.backend.value if mask is not None else "hf:" + _attn_impl(trainer.model)] += 1
                return kwargs
            return probe.timed("mask", wrapper)

        def capture_forward_inputs(fn):
            def wrapper(batch, **mask_kwargs):
                if probe.forward_inputs is None:
                    probe.forward_inputs = (batch, mask_kwargs)
                return fn(batch, **mask_kwargs)
            return probe.timed("forward", wrapper)

        def capture_block_inputs(module, args, kwargs):
            if probe.block_inputs is None:
                probe.block_inputs = (tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs))

        optimizer_t0 = []

        def before_step(*_) -> None:  # optimizer hooks must return None (else they replace args/kwargs)
            probe.sync()
            optimizer_t0.append(time.perf_counter())

        def after_step(*_) -> None:
            probe.sync()
            probe.times["optimizer"] += time.perf_counter() - optimizer_t0.pop()

        pre = trainer.optimizer.register_step_pre_hook(before_step)
        post = trainer.optimizer.register_step_post_hook(after_step)
        block_hook = decoder_layers(trainer.model)[0].register_forward_pre_hook(capture_block_inputs, with_kwargs=True)
        tok_cls = type(trainer.tokenizer)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_patched(trainer.loader, "next_batch", lambda f: self.timed("data", f)))
            stack.enter_context(_patched(trainer, "_mask_kwargs", record_mask))
            stack.enter_context(_patched(trainer, "train_module", capture_forward_inputs))
            stack.enter_context(_patched(torch.Tensor, "backward", lambda f: self.timed("backward", f)))
            for name in ("__call__", "encode", "batch_encode_plus"):
                if hasattr(tok_cls, name):
                    stack.enter_context(_patched(tok_cls, name, count_calls))
            try:
                yield self
            finally:
                pre.remove()
                post.remove()
                block_hook.remove()


def _attn_impl(model: nn.Module) -> str:
    return str(getattr(model.config, "_attn_implementation", "?"))


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"frames_compiled": int(counters["frames"]["ok"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "unique_graphs": int(counters["stats"]["unique_graphs"])}


# -- memory -----------------------------------------------------------------------------------------------
def _unwrapped_block_forward(layer: nn.Module) -> Callable:
    """The block's own forward, without checkpoint/compile wrappers (instance attributes or wrapper modules)."""
    inner = getattr(layer, "_checkpoint_wrapped_module", layer)
    return type(inner).forward.__get__(inner)


def block_activation_bytes(layer: nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes one decoder block keeps alive for backward *without* checkpointing (flexengine.memory.meter)."""
    from flexengine.memory.meter import measure_activations

    hidden = args[0].detach().requires_grad_(True)
    forward = _unwrapped_block_forward(layer)
    with torch.enable_grad():
        report, _ = measure_activations(layer, lambda: forward(hidden, *args[1:], **kwargs), layers=nn.ModuleList())
    return report.total_bytes


def current_policy_bytes(trainer, batch: dict, mask_kwargs: dict) -> Optional[list]:
    """Bytes each block keeps for backward under the policy this run applied (None for compiled blocks: the
    meter's dispatch mode needs eager code)."""
    from flexengine.memory.meter import measure_activations

    if trainer.job.train.compile:
        return None
    with torch.enable_grad(), trainer._autocast():
        report, _ = measure_activations(trainer.model, lambda: trainer.train_module(batch, **mask_kwargs))
    return report.per_block


def checkpointed_blocks(model: nn.Module) -> list[int]:
    """Decoder blocks that recompute in backward: the block or one of its parts has its forward wrapped
    (flexengine.memory.policy.wrap_checkpoint sets an instance `forward`), or is torch's CheckpointWrapper."""
    return [i for i, layer in enumerate(decoder_layers(model))
            if any("forward" in vars(m) or hasattr(m, "_checkpoint_wrapped_module") for m in layer.modules())]


def memory_report(trainer, probe: StepProbe) -> dict:
    """Activation bytes per block (measured) and how many blocks must be checkpointed to fit the budget."""
    job, model = trainer.job, trainer.model
    layers = decoder_layers(model)
    n_layers = len(layers)
    if probe.block_inputs is None:
        return {"error": "decoder block 0 never ran"}
    args, kwargs = probe.block_inputs
    act = block_activation_bytes(layers[0], args, kwargs)
    kept_input = args[0].numel() * args[0].element_size()  # a checkpointed block still holds its input
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    optim_state = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                      for t in s.values() if torch.is_tensor(t))
    static = 2 * weights + optim_state  # weights + their grads + AdamW moments
    B, S = args[0].shape[:2]
    vocab = model.get_output_embeddings().weight.shape[0]
    logits_tokens = min(job.loss.chunk_size, B * S) if job.loss.chunk_size > 0 else B * S
    logits = 2 * logits_tokens * vocab * 4  # fp32 logits + their log-softmax, saved for backward
    budget = job.hardware.memory_gb * 2**30 * MEMORY_HEADROOM
    free_for_blocks = budget - static - logits - n_layers * kept_input
    extra_per_kept_block = max(1, act - kept_input)
    fit = int(min(n_layers, max(0, free_for_blocks // extra_per_kept_block)))
    report = {
        "activation_bytes_per_block": act, "checkpointed_block_bytes": kept_input, "static_bytes": static,
        "logits_bytes": logits, "budget_bytes": int(budget), "n_layers": n_layers,
        "checkpointed": checkpointed_blocks(model), "must_checkpoint": n_layers - fit,
        "measured_bytes_per_block": current_policy_bytes(trainer, *probe.forward_inputs),
        "estimated_peak_bytes_no_checkpoint": int(static + logits + n_layers * act),
        "planner": planner_report(trainer, B, S),
    }
    return report


def planner_report(trainer, micro_batch: int, seq_len: int) -> dict:
    """flexengine.memory.planner's bytes model for this run (per block: no checkpointing and the current
    policy) and its own policy choice, to set against the measurement; guarded, the planner may be absent."""
    try:
        from flexengine.memory import planner
    except ImportError:
        return {"available": False, "note": "flexengine.memory.planner is not in this build"}
    job, model = trainer.job, trainer.model
    try:
        dtype_bytes = next(model.parameters()).element_size()
        backend = "dense" if trainer.attn.backend is AttnBackend.DENSE else "flex"  # HF sdpa keeps O(S) like flex
        inputs = planner.PlanInputs(seq_len=seq_len, micro_batch=micro_batch, dtype_bytes=dtype_bytes,
                                    hardware=job.hardware, chunk_size=job.loss.chunk_size, backend=backend,
                                    grad_accum=job.train.grad_accum)
        plan = planner.plan_memory(model.config, inputs)
        shape = planner.ModelShape.from_hf_config(model.config)
        workload = planner.Workload(micro_batch, seq_len, dtype_bytes, backend, job.loss.chunk_size)
        current = planner.estimate_activations(shape, workload, job.memory).per_block
    except Exception as e:  # another planner version: report it, never fail the diagnosis
        return {"available": True, "error": f"{type(e).__name__}: {e}"}
    return {"available": True, "policy": plan["policy"], "memory": plan["memory"], "fits": plan["fits"],
            "total_bytes": plan["total_bytes"], "budget_bytes": plan["budget_bytes"],
            "block_bytes_no_checkpoint": plan["activation_bytes_per_block"]["none"][0],
            "block_bytes_current_policy": current}


# -- the run ------------------------------------------------------------------------------------------------
def diagnose(job: JobConfig, out_dir: Path, steps: int = 4, warmup: int = 1, trainer=None) -> dict:
    """Run warmup + steps optimizer steps under the probe; returns the report (also written to doctor.json)."""
    from flexengine.run import build_trainer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    job.train.progress = False
    trainer = trainer if trainer is not None else build_trainer(job, out_dir)
    probe = StepProbe(trainer.device)
    trainer.model.train()
    per_step, counts = [], {"start": _dynamo_counts()}
    counts["after_warmup"] = counts["start"]
    with probe.attach(trainer):
        for i in range(warmup + steps):
            if i == warmup:
                counts["after_warmup"] = _dynamo_counts()
                probe.tokenizer_calls = 0  # count only the measured (steady-state) steps
            probe.times.clear()
            probe.sync()
            t0 = time.perf_counter()
            m = trainer.train_step()
            probe.sync()
            total = time.perf_counter() - t0
            phases = {p: probe.times.get(p, 0.0) for p in PHASES[:-1]}
            phases["other"] = max(0.0, total - sum(phases.values()))
            per_step.append({**m, "time_s": total, "phases": phases, "warmup": i < warmup})
    counts["end"] = _dynamo_counts()
    report = build_report(trainer, per_step, counts, probe, memory_report(trainer, probe))
    write_json_atomic(out_dir / "doctor.json", report)
    trainer.metrics.close()
    return report


def build_report(trainer, per_step: list, counts: dict, probe: StepProbe, memory: dict) -> dict:
    """Numbers -> checks (verdict ok / info / warn / bad, with details) -> suggestions."""
    job, device = trainer.job, trainer.device
    measured = [s for s in per_step if not s["warmup"]] or per_step
    wall = sum(s["time_s"] for s in measured)
    tokens, useful = sum(s["tokens"] for s in measured), sum(s["useful_tokens"] for s in measured)
    phase_s = {p: sum(s["phases"][p] for s in measured) for p in PHASES}
    sparsity = [s["block_sparsity"] for s in measured if s["block_sparsity"] is not None]
    numbers = {
        "device": str(device), "attn_mode": job.attn.mode, "attn_backend": trainer.attn.backend.value,
        "attn_backend_requested": job.attn.backend, "attn_implementation": _attn_impl(trainer.model),
        "mask_backends_seen": dict(probe.mask_backends), "attn_compile": job.attn.compile,
        "train_compile": job.train.compile, "steps_measured": len(measured),
        "recompiles_after_warmup": counts["end"]["frames_compiled"] - counts["after_warmup"]["frames_compiled"],
        "graph_breaks": counts["end"]["graph_breaks"] - counts["start"]["graph_breaks"],
        "frames_compiled": counts["end"]["frames_compiled"] - counts["start"]["frames_compiled"],
        "useful_token_fraction": useful / max(1, tokens), "padding_waste": 1 - useful / max(1, tokens),
        "block_sparsity": sum(sparsity) / len(sparsity) if sparsity else None,
        "step_s": wall / len(measured), "tokens_per_s": tokens / wall, "useful_tokens_per_s": useful / wall,
        "mfu": useful / wall * trainer.flops_per_token / (job.hardware.peak_tflops * 1e12),
        "peak_tflops": job.hardware.peak_tflops, "time_split": {p: phase_s[p] / wall for p in PHASES},
        "tokenizer_calls_in_loop": probe.tokenizer_calls, "memory": memory,
        "losses": [s["loss"] for s in per_step],
    }
    checks = run_checks(job, numbers)
    return {"numbers": numbers, "checks": checks,
            "suggestions": [c["suggestion"] for c in checks if c.get("suggestion")],
            "config": asdict(job)}


def _check(name: str, verdict: str, value: str, detail: str = "", suggestion: str = "") -> dict:
    return {"name": name, "verdict": verdict, "value": value, "detail": detail, "suggestion": suggestion}


def run_checks(job: JobConfig, n: dict) -> list[dict]:
    """The verdicts, one per question a slow run raises; each warn/bad carries a concrete suggestion."""
    on_cuda = n["device"].startswith("cuda")
    backend, mode = n["attn_backend"], n["attn_mode"]
    checks = []
    # attention backend: what ran, and why
    if backend == "sdpa":
        # the padding it costs is judged (and the fix suggested) by the useful-tokens check below
        checks.append(_check("attention", "info", f"HF sdpa ({mode}), one document per row",
                             "the padded baseline: every row is padded to the batch's longest document"))
    elif backend == "dense" and on_cuda:
        checks.append(_check("attention", "warn", f"dense ({mode})", "materialises a [B, 1, S, S] mask per batch",
                             "dense attention masks on GPU: use attn.backend=flex (or auto)"))
    elif backend == "flex" and not job.attn.compile:
        checks.append(_check("attention", "warn", f"flex ({mode}), not compiled", "uncompiled flex materialises scores",
                             "FlexAttention runs uncompiled: set attn.compile=true"))
    else:
        why = "auto picks dense on CPU (FlexAttention has no CPU backward)" if backend == "dense" else ""
        checks.append(_check("attention", "ok", f"{backend} ({mode})", why))
    # compilation
    recompiles, breaks = n["recompiles_after_warmup"], n["graph_breaks"]
    if recompiles or breaks:
        checks.append(_check("compile", "warn", f"{recompiles} recompiles after warm-up, {breaks} graph breaks",
                             "each recompile stalls a step; each graph break splits a block's graph",
                             "keep shapes fixed (pack every row to data.seq_len) and look at "
                             "TORCH_LOGS=recompiles,graph_breaks"))
    elif on_cuda and not job.train.compile:
        checks.append(_check("compile", "warn", "decoder blocks run eagerly", "",
                             "compile the decoder blocks: train.compile=true"))
    else:
        checks.append(_check("compile", "ok", f"{n['frames_compiled']} frames compiled, no recompiles after warm-up"))
    # data: padding waste and tokenisation in the loop
    frac = n["useful_token_fraction"]
    verdict = "ok" if frac >= 0.9 else ("warn" if frac >= 0.6 else "bad")
    suggestion = "" if verdict == "ok" else (
        f"{n['padding_waste']:.0%} of the tokens computed are padding: "
        + ("enable attn=packed_doc (packs documents with per-document masks)" if not job.attn.packs_documents
           else "use data.packing=bfd, or a data.seq_len closer to your document lengths"))
    checks.append(_check("useful tokens", verdict, f"{frac:.1%} useful, {n['padding_waste']:.1%} padding", "",
                         suggestion))
    calls = n["tokenizer_calls_in_loop"]
    checks.append(_check("tokenization in loop", "ok" if calls == 0 else "bad", f"{calls} tokenizer calls",
                         "documents must be tokenized once, before training",
                         "" if calls == 0
                         else "the tokenizer runs inside the training loop: tokenize once (data cache)"))
    sp = n["block_sparsity"]
    checks.append(_check("block sparsity", "info", "n/a (HF attention)" if sp is None else f"{sp:.1%} of causal blocks",
                         "share of a causal mask's attention blocks actually computed (lower = more skipped)"))
    # time split and throughput
    split = n["time_split"]
    verdict = "warn" if split["data"] + split["mask"] > 0.2 else "ok"
    checks.append(_check("time split", verdict, ", ".join(f"{p} {split[p]:.0%}" for p in PHASES),
                         "", "" if verdict == "ok" else "data loading / mask building takes over 20% of the step: "
                         "raise train.micro_batch or check data.num_workers and the mask backend"))
    mfu = n["mfu"]
    verdict = "warn" if on_cuda and mfu < 0.2 else "info"
    checks.append(_check("throughput", verdict,
                         f"{n['tokens_per_s']:.0f} tokens/s, {n['useful_tokens_per_s']:.0f} useful/s, "
                         f"MFU {mfu:.1%} of {n['peak_tflops']} TFLOP/s", "MFU counts useful tokens only",
                         "" if verdict != "warn" else "MFU under 20%: see the time split and the suggestions above"))
    checks.extend(memory_checks(job, n["memory"]))
    return checks


def memory_checks(job: JobConfig, mem: dict) -> list[dict]:
    """Checkpointing more blocks than the budget needs costs recompute; fewer than it needs will not fit."""
    if "error" in mem:
        return [_check("memory", "info", mem["error"])]
    L, have, need = mem["n_layers"], len(mem["checkpointed"]), mem["must_checkpoint"]
    gib = 2**30
    value = (f"{mem['activation_bytes_per_block'] / gib:.3g} GiB saved per block, checkpointing {have} of {L}, "
             f"{need} needed to fit {mem['budget_bytes'] / gib:.3g} GiB")
    detail = "measured on block 0 without checkpointing; budget = 90% of hardware.memory_gb"
    plan = mem.get("planner", {})
    if "policy" in plan:
        detail += (f"; planner: {plan['block_bytes_no_checkpoint'] / gib:.3g} GiB per block, "
                   f"its choice: {plan['policy']}")
    if have > need:
        fix = "memory=none" if need == 0 else "memory=auto"
        return [_check("memory", "warn", value, detail,
                       f"checkpointing {have} of {L} blocks but only {need} must be to fit the budget: {fix} "
                       f"(saves ~{have - need} blocks of recompute)")]
    if have < need:
        return [_check("memory", "bad", value, detail,
                       f"checkpointing {have} of {L} blocks but {need} are needed to fit hardware.memory_gb="
                       f"{job.hardware.memory_gb}: memory=full (or memory=auto)")]
    return [_check("memory", "ok", value, detail)]


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


def main(argv: Optional[list[str]] = None) -> dict:
    """CLI: parse --steps/--out, compose the overrides, diagnose, print, write doctor.json."""
    parser = argparse.ArgumentParser(prog="python -m flexengine.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="the same overrides as python -m flexengine.train")
    parser.add_argument("--steps", type=int, default=4, help="measured optimizer steps (after 1 warm-up step)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output dir (default train.output_dir or outputs/doctor/<time>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        job = compose_job(args.overrides)
        out = args.out or Path(job.train.output_dir or Path("outputs/doctor") / time.strftime("%Y-%m-%d/%H-%M-%S"))
        report = diagnose(job, out, steps=args.steps)
    except UserError as e:
        print(f"\nflexengine: error: {e}\n", file=sys.stderr)
        sys.exit(2)
    print(format_report(report))
    print(f"\nwritten: {out / 'doctor.json'}")
    return report


if __name__ == "__main__":
    main()
