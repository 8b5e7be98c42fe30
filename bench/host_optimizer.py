"""The bf16_cpu_master host optimizer (flexengine.loop.host_adamw) against the planner's host terms, and against the
foreach step it replaced: peak RSS of a real training step, host bytes held, time per parameter, PCIe bytes.

CPU only (the "device" is the CPU: the same code path, plain buffers instead of pinned ones). A scaled LLaMA
(~207M parameters, bf16 weights) trains through flexengine's Trainer with precision=bf16_cpu_master; each variant
runs in its own process so its peak RSS (VmHWM, reset before the measured step) is its own:
  baseline   the same steps with an optimizer that holds nothing (SGD, lr 0): weights, grads, activations
  new        CPUOffloadAdamW as shipped (fused AdamW, bf16 transfer slots, hooks in the last backward)
  old        the replaced step, reproduced below: fp32 grads to the host, foreach AdamW, fp32 weights back
host peak = peak RSS(variant) - peak RSS(baseline): what the optimizer adds to a step at its worst moment.

    .venv/bin/python bench/host_optimizer.py            # writes bench/results/host_optimizer.{json,md}
    .venv/bin/python bench/host_optimizer.py --report   # the same tables from the saved runs (planner changed)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from flexengine.core.config import HardwareConfig, JobConfig, OptimConfig, PrecisionConfig, TrainConfig
from flexengine.core.distributed import DistInfo
from flexengine.core.parallel_spec import ParallelSpec
from flexengine.data.corpus import Corpus
from flexengine.data.loader import RowLoader
from flexengine.data.packing import flatten_documents, plan_packing
from flexengine.loop.components import build_components
from flexengine.loop.forward import ForwardPath
from flexengine.loop.trainer import Trainer
from flexengine.planning.costs import HOST_STEP_NS_PER_PARAM, host_optimizer_bytes, host_optimizer_seconds
from flexengine.planning.shapes import ModelShape
from flexengine.resolve import resolve
from flexengine.run import trainer_setup
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.precision import SPECS

RESULTS = Path(__file__).parent / "results"
MODEL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=4096,
    use_cache=False,
    tie_word_embeddings=False,
)
SEQ_LEN, GRAD_ACCUM = 128, 2
TIMED_CALLS = 3  # host steps timed on one thread after the measured training step (same gradients)
GiB = 2**30
# The planner's host bytes per parameter for this mode before the pinned host optimizer: fp32 master + two fp32
# states + an fp32 gradient copy (the pinned rounding on CUDA was not counted)
PLANNED_BEFORE_BYTES_PER_PARAM = 16


class ForeachOffloadAdamW(torch.optim.AdamW):
    """The earlier host optimizer, CPUOffloadAdamW, this bench compares against: fp32 masters, fp32 gradients
    copied to the host each step (a new tensor per parameter), foreach AdamW (a full-size sqrt temporary), fp32
    weights copied back. On CUDA its masters were pinned through the caching host allocator (rounded to powers of
    two)."""

    def __init__(self, params):
        self._pairs = [(p, nn.Parameter(p.detach().to("cpu", torch.float32, copy=True))) for p in params]
        super().__init__([m for _, m in self._pairs], lr=2e-5, foreach=True)

    @torch.no_grad()
    def step(self, closure=None):
        for device_p, master in self._pairs:
            master.grad = None if device_p.grad is None else device_p.grad.to("cpu", torch.float32)
        super().step()
        for device_p, master in self._pairs:
            device_p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for device_p, master in self._pairs:
            device_p.grad = master.grad = None


def _rss() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _loader() -> RowLoader:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, MODEL["vocab_size"], int(k)) for k in rng.integers(20, 120, 400)]
    tokens, offsets = flatten_documents(docs)
    corpus = Corpus(tokens=tokens, offsets=offsets)
    return RowLoader(
        corpus, plan_packing(corpus.lengths, SEQ_LEN, "bfd"), seq_len=SEQ_LEN, micro_batch=1, pad_id=0, shuffle=False
    )


def _job() -> JobConfig:
    job = JobConfig(
        optim=OptimConfig(lr=2e-5, warmup_steps=0, grad_clip=1.0, name="adamw_cpu_offload", weight_decay=0.0),
        precision=PrecisionConfig(mode="bf16_cpu_master"),
        train=TrainConfig(micro_batch=1, grad_accum=GRAD_ACCUM, max_steps=100, progress=False, save_final=False),
    )
    job.data.seq_len = SEQ_LEN
    return job


def run_variant(variant: str) -> dict:
    """One variant in this process: a warm-up step, then MEASURED_STEPS steps with the peak RSS reset before."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).to(torch.bfloat16)
    patch_attention(model, mode="packed_doc", backend="dense")
    job = _job()
    if variant != "new":
        job.optim.name = "adamw"  # a torch AdamW that never steps (holds nothing), replaced below
    forward = ForwardPath.build(job.loss, model, torch.device("cpu"), precision=SPECS["bf16_cpu_master"])
    setup = trainer_setup(job, model, parallel=ParallelSpec())  # one process: no gradient sync to choose
    out = Path("/tmp/host_optimizer_bench")
    trainer = Trainer(setup, build_components(setup, forward, _loader(), None, out_dir=out, dist=DistInfo()))
    if variant == "baseline":
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    elif variant == "old":
        trainer.optimizer = ForeachOffloadAdamW(list(model.parameters()))
    timings: list[tuple[float, float]] = []  # (CPU s, wall s) of each timed host step
    real_step = trainer.optimizer.step
    threads = torch.get_num_threads()

    def step_then_time(*args, **kwargs):
        out = real_step(*args, **kwargs)
        # Then the host step alone, TIMED_CALLS times on the same gradients, on one thread, in CPU seconds: the
        # machine is shared (wall time here runs ~3x CPU time under the other jobs' load). Later calls download
        # the gradients in step() (the first one found them downloaded by the hooks): a ~0.2 ns/param copy more.
        torch.set_num_threads(1)
        for _ in range(TIMED_CALLS):
            cpu, wall = time.process_time(), time.perf_counter()
            real_step(*args, **kwargs)
            timings.append((time.process_time() - cpu, time.perf_counter() - wall))
        torch.set_num_threads(threads)
        return out

    trainer.train_step()  # warm-up: AdamW's states are allocated in the first step
    _reset_peak()
    trainer.optimizer.step = step_then_time
    t0 = time.perf_counter()
    trainer.train_step()
    wall = time.perf_counter() - t0
    n = sum(p.numel() for p in model.parameters())
    cpu_s, wall_s = min(timings)
    out = {
        "variant": variant,
        "params": n,
        "peak_rss_bytes": _rss()["VmHWM"],
        "rss_bytes": _rss()["VmRSS"],
        "train_step_s": wall,
        "host_step_cpu_s": cpu_s,
        "host_step_wall_s": wall_s,
        "host_step_ns_per_param": cpu_s / n * 1e9,
        "threads": threads,
    }
    if variant == "new":
        out["host_bytes"] = trainer.optimizer.host_bytes()
        out["pinned"] = trainer.optimizer.pinned
        out["hook_downloads"] = trainer.optimizer.hook_downloads
        slots = sum(s.numel() * s.element_size() for s in trainer.optimizer._slots)
        out["pcie_bytes_per_step"] = 2 * slots  # each slot goes down (grad) and up (weights) once a step
    elif variant == "old":
        out["pcie_bytes_per_step"] = 2 * 4 * n  # fp32 both ways (55 GB a step at 6.9B)
    return out


def kernel_ns_per_param(numel: int = 50_000_000) -> list[dict]:
    """The AdamW kernels alone on `numel` fp32 parameters, fused vs foreach (CPU seconds: a shared machine)."""
    rows = []
    threads = torch.get_num_threads()
    for n_threads in sorted({1, threads}):
        torch.set_num_threads(n_threads)
        for impl in ("fused", "foreach"):
            p = nn.Parameter(torch.randn(numel) * 0.02)
            p.grad = torch.randn(numel) * 1e-3
            opt = torch.optim.AdamW([p], lr=2e-5, fused=impl == "fused", foreach=impl == "foreach")
            opt.step()
            times = []
            for _ in range(3):
                t0 = time.process_time()
                opt.step()
                times.append(time.process_time() - t0)
            rows.append({"kernel": impl, "threads": n_threads, "cpu_ns_per_param": min(times) / numel * 1e9})
            del opt, p
    torch.set_num_threads(threads)
    return rows


def planned(n_params: int) -> dict:
    """The planner's host terms for this model (bf16_cpu_master, one device)."""
    shape = ModelShape.from_hf_config(LlamaConfig(**MODEL))
    assert shape.params == n_params, (shape.params, n_params)
    hardware = HardwareConfig(name="a100_80g", device="cuda", memory_gb=79.3, peak_tflops=312, host_memory_gb=128)
    job, config = _job(), LlamaConfig(**MODEL)
    run = resolve(job, config, hardware)
    assert run.precision == SPECS["bf16_cpu_master"], run.precision.name
    x = run.inputs(batch_of=run.planned)  # at the job's own micro-batch and accumulation, as the bench steps
    seconds, pcie = host_optimizer_seconds(shape, x, compute_s=0.0)
    return {"host_bytes": host_optimizer_bytes(shape, x), "pcie_bytes_per_step": pcie, "host_step_s": seconds}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        print(json.dumps(run_variant(sys.argv[2])))
        return
    runs = {}
    if sys.argv[1:] == ["--report"]:
        saved = json.loads((RESULTS / "host_optimizer.json").read_text())
        runs, machine = saved["runs"], saved["machine"]
    else:
        machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "load": os.getloadavg()}
        for variant in ("baseline", "new", "old"):
            out = subprocess.run(
                [sys.executable, __file__, "--variant", variant], capture_output=True, text=True, check=True
            ).stdout
            runs[variant] = json.loads(out.strip().splitlines()[-1])
            print(variant, runs[variant], flush=True)
    n = runs["new"]["params"]
    plan = planned(n)
    base = runs["baseline"]["peak_rss_bytes"]
    rows = []
    for variant, planned_bytes in (("new", plan["host_bytes"]), ("old", PLANNED_BEFORE_BYTES_PER_PARAM * n)):
        r = runs[variant]
        rows.append(
            {
                "variant": variant,
                "host_peak_bytes": r["peak_rss_bytes"] - base,
                "planned_host_bytes": planned_bytes,
                "host_peak_vs_plan": (r["peak_rss_bytes"] - base) / planned_bytes,
                "host_step_ns_per_param": r["host_step_ns_per_param"],
                "pcie_bytes_per_step": r["pcie_bytes_per_step"],
                "train_step_s": r["train_step_s"],
            }
        )
    result = {
        "model": MODEL,
        "params": n,
        "seq_len": SEQ_LEN,
        "grad_accum": GRAD_ACCUM,
        "machine": machine,
        "runs": runs,
        "planned": plan,
        "planner_host_step_ns_per_param": HOST_STEP_NS_PER_PARAM,
        "rows": rows,
        "kernels": kernel_ns_per_param(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "host_optimizer.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "host_optimizer.md").write_text(_markdown(result))
    print(_markdown(result))


def _markdown(r: dict) -> str:
    n, plan, new = r["params"], r["planned"], r["runs"]["new"]
    held = new["host_bytes"]
    lines = [
        "# bf16_cpu_master host optimizer: measured vs planned (bench/host_optimizer.py)",
        "",
        (
            f"LLaMA {r['params'] / 1e6:.0f}M parameters (H{r['model']['hidden_size']} "
            f"L{r['model']['num_hidden_layers']} "
            f"V{r['model']['vocab_size']}), bf16 weights, seq_len {r['seq_len']} x grad_accum {r['grad_accum']}, "
            f"CPU ({r['machine']['cores']} cores, load {r['machine']['load'][0]:.1f}, {new['threads']} torch threads; "
            "shared machine). Host peak = peak RSS of a training step minus that of the same step with an optimizer "
            "that holds nothing."
        ),
        "",
        (
            "| step | host peak GiB | planned GiB (its plan) | peak / plan | host step CPU ns/param (1 thread) | "
            "PCIe bytes/step (per param) | train step s (wall) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['variant']} | {row['host_peak_bytes'] / GiB:.2f} | {row['planned_host_bytes'] / GiB:.2f} | "
            f"{row['host_peak_vs_plan']:.3f} | "
            f"{row['host_step_ns_per_param']:.2f} | {row['pcie_bytes_per_step'] / GiB:.2f} GiB "
            f"({row['pcie_bytes_per_step'] / n:.1f}) | {row['train_step_s']:.1f} |"
        )
    lines += [
        "",
        (
            f"Planned host bytes (planning/costs.host_optimizer_bytes): {plan['host_bytes'] / GiB:.3f} GiB "
            f"({plan['host_bytes'] / n:.2f} B/param); PCIe {plan['pcie_bytes_per_step'] / n:.1f} B/param a step."
        ),
        (
            f"Held by the new optimizer (host_bytes()): masters {held['masters'] / GiB:.3f}, states "
            f"{held['states'] / GiB:.3f}, transfer buffer {held['transfer_buffer'] / GiB:.3f} "
            f"(pinned: {new['pinned']}), "
            f"grad scratch {held['grad_scratch'] / GiB:.3f} GiB = {sum(held.values()) / GiB:.3f} GiB "
            f"({sum(held.values()) / plan['host_bytes']:.3f} of the plan). Gradients downloaded by hooks in the last "
            f"backward: {new['hook_downloads']}."
        ),
        f"Planner's host step: {r['planner_host_step_ns_per_param']} ns/param.",
        "",
        "AdamW kernels alone (50M fp32 parameters; CPU ns summed over threads):",
        "",
        "| kernel | threads | CPU ns/param |",
        "|---|---|---|",
    ]
    lines += [f"| {k['kernel']} | {k['threads']} | {k['cpu_ns_per_param']:.2f} |" for k in r["kernels"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
