"""Activation bytes (meter) vs step time per memory policy; the planner's estimate alongside.

CPU (default): a tiny and a mid-size LLaMA, dense attention, fp32.
GPU (`--gpu`, for bench/gpu_check.sh): a 7B-shaped LLaMA with few layers at 8K, flex attention, bf16, reporting
torch.cuda.max_memory_allocated per step as well.

    .venv/bin/python bench/memory.py            # writes bench/results/memory.{json,md,png}
    .venv/bin/python bench/memory.py --gpu      # writes bench/results/memory_gpu.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flexengine.core.config import MemoryConfig
from flexengine.planning.activations import estimate_activations, memory_specs
from flexengine.planning.shapes import ModelShape, Workload
from flexengine.surgery.attention import patch_attention
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.loss import forward_loss_sum
from flexengine.surgery.memory import apply_memory_policy, block_memory_specs, measure_activations

RESULTS = Path(__file__).parent / "results"

POLICIES = {
    "none": MemoryConfig(),
    "full": MemoryConfig(policy="full"),
    "every-2": MemoryConfig(policy="full", layers="every_2"),
    "every-4": MemoryConfig(policy="full", layers="every_4"),
    "attention-only": MemoryConfig(policy="selective", granularity="attention"),
    "mlp-only": MemoryConfig(policy="selective", granularity="mlp"),
    "op-level SAC": MemoryConfig(policy="selective", granularity="ops"),
    "offload": MemoryConfig(policy="offload"),
    "full + offload": MemoryConfig(policy="full", offload=True),
}

CPU_MODELS = {
    "tiny (H256 L4)": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
        seq_len=1024,
    ),
    "mid (H512 L6)": dict(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        seq_len=1024,
    ),
}
GPU_MODELS = {
    "7B-shaped (L4)": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        seq_len=8192,
    ),
}


def build(arch: dict, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A randomly initialised LLaMA of `arch` (no seq_len key) on device."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        **{k: v for k, v in arch.items() if k != "seq_len"},
        use_cache=False,
        max_position_embeddings=arch["seq_len"],
        tie_word_embeddings=False,
    )
    with device:
        return LlamaForCausalLM(cfg).to(dtype)


def run_policy(arch: dict, memory: MemoryConfig, device: torch.device, steps: int) -> dict:
    """Meter one forward, then time `steps` forward+backward steps."""
    gpu = device.type == "cuda"
    model = build(arch, device, torch.bfloat16 if gpu else torch.float32)
    patch_attention(model, mode="causal", backend="flex" if gpu else "dense")
    apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
    model.train()
    S = arch["seq_len"]
    ids = torch.randint(0, arch["vocab_size"], (1, S), device=device)
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(S, device=device)[None]}
    report, out = measure_activations(model, lambda: forward_loss_sum(model, batch, chunk_size=1024))
    out.backward()
    del out
    times = []
    for _ in range(steps):
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        forward_loss_sum(model, batch, chunk_size=1024).backward()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    shape = ModelShape.from_hf_config(model.config)
    backend = AttnBackend.FLEX if gpu else AttnBackend.DENSE
    est = estimate_activations(shape, Workload(1, S, 2 if gpu else 4, backend, 1024), memory_specs(memory, shape))
    return {
        "activation_bytes": report.total_bytes,
        "offloaded_bytes": report.offloaded_bytes,
        "per_block_bytes": report.per_block,
        "planner_bytes": est.total_bytes,
        "planner_error": est.total_bytes / report.total_bytes - 1,
        "step_s": min(times),
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if gpu else None,
    }


def pareto(rows: list[dict]) -> set[str]:
    """Policies no other policy beats on both bytes and time."""
    return {
        r["policy"]
        for r in rows
        if not any(
            o["activation_bytes"] <= r["activation_bytes"]
            and o["step_s"] <= r["step_s"]
            and o is not r
            and (o["activation_bytes"] < r["activation_bytes"] or o["step_s"] < r["step_s"])
            for o in rows
        )
    }


def main() -> None:
    """Run every policy on every model; print and write the results."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda" if args.gpu else "cpu")
    models = GPU_MODELS if args.gpu else CPU_MODELS
    results = {"device": torch.cuda.get_device_name() if args.gpu else "cpu", "torch": torch.__version__, "models": {}}
    lines = []
    for name, arch in models.items():
        rows = []
        for label, memory in POLICIES.items():
            if args.gpu:
                torch.cuda.empty_cache()
            rows.append({"policy": label, **run_policy(arch, memory, device, args.steps)})
        front = pareto(rows)
        results["models"][name] = {"arch": arch, "rows": rows, "pareto": sorted(front)}
        lines += [
            f"### {name}, seq_len {arch['seq_len']}",
            "",
            "| policy | activations (MiB) | offloaded (MiB) | planner (MiB) | planner err | step (s) |"
            + (" peak CUDA (GiB) |" if args.gpu else "")
            + " Pareto |",
            "|---|---|---|---|---|---|" + ("---|" if args.gpu else "") + "---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['policy']} | {r['activation_bytes'] / 2**20:.1f} | "
                f"{r['offloaded_bytes'] / 2**20:.1f} | {r['planner_bytes'] / 2**20:.1f} | "
                f"{100 * r['planner_error']:+.2f}% | {r['step_s']:.3f} |"
                + (f" {r['peak_cuda_bytes'] / 2**30:.2f} |" if args.gpu else "")
                + (" * |" if r["policy"] in front else " |")
            )
        lines.append("")
    text = "\n".join(lines)
    print(text)
    stem = "memory_gpu" if args.gpu else "memory"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (RESULTS / f"{stem}.md").write_text(
        f"# Activation memory vs step time ({results['device']}, torch "
        f"{torch.__version__})\n\nMeter = bytes alive for backward after one forward "
        "(device only; offloaded host copies apart). Step = fastest of 3 "
        "forward+backward steps; on a shared 2-core CPU the times are noisy. "
        "* = on the Pareto front.\n\n" + text + "\n"
    )
    plot(results, RESULTS / f"{stem}.png")


def plot(results: dict, path: Path) -> None:
    """Bytes vs time per model, the Pareto front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["models"]), figsize=(6 * len(results["models"]), 4.5), squeeze=False)
    for ax, (name, res) in zip(axes[0], results["models"].items()):
        rows = res["rows"]
        for r in rows:
            ax.scatter(r["step_s"], r["activation_bytes"] / 2**20, color="C3" if r["policy"] in res["pareto"] else "C0")
            ax.annotate(
                r["policy"],
                (r["step_s"], r["activation_bytes"] / 2**20),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        front = sorted((r for r in rows if r["policy"] in res["pareto"]), key=lambda r: r["step_s"])
        ax.plot([r["step_s"] for r in front], [r["activation_bytes"] / 2**20 for r in front], color="C3", lw=1)
        ax.set_xlabel("step time (s)")
        ax.set_ylabel("activation bytes kept for backward (MiB)")
        ax.set_title(f"{name}, S={res['arch']['seq_len']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
