"""Long rows on CPU: activation bytes per memory policy from 4K to 128K tokens, measured on deepseek-llm-7b's
full depth (30 blocks) at 1/64 of its width, against the planner; the planner's bytes at 7B width beside them
(scaled by the measured/planned ratio); and the step-time overhead of the tiled MLP at a length that fits.

Every per-token activation of a block is linear in the width (hidden, heads x head_dim, intermediate), so bytes
measured at 1/64 width times the planner's 7B/narrow ratio is what the 7B holds. Documents are 128 tokens back to
back (positions restart) with the dense backend's 128-query chunks, so the CPU's dense attention costs
O(S x 128), not O(S^2): the same per-token tensors as flex on a GPU, plus the dense backend's small chunk masks.

    PYTHONPATH=. .venv/bin/python bench/long_context.py      # writes bench/results/long_context.{json,md,png}
"""

from __future__ import annotations

import argparse
import gc
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
GiB = 2**30
LENGTHS = [4096, 8192, 16384, 32768, 65536, 131072]
DOC, CHUNK, LOSS_CHUNK, TILE = 128, 128, 1024, 4096  # TILE: memory.tiled_mlp=auto at 7B width (hidden 4096)
POLICIES = {
    "none": MemoryConfig(),
    "op-level SAC": MemoryConfig(policy="selective", granularity="ops"),
    "tiled MLP": MemoryConfig(tiled_mlp=TILE),
    "full": MemoryConfig(policy="full"),
    "full + tiled MLP": MemoryConfig(policy="full", tiled_mlp=TILE),
    "full + offload": MemoryConfig(policy="full", offload=True),
    "full + offload + tiled MLP": MemoryConfig(policy="full", offload=True, tiled_mlp=TILE),
}
DEEPSEEK_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=30,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=128,
    vocab_size=102400,
)
NARROW = dict(
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=30,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=2,
    vocab_size=1600,
)  # every width / 64, heads kept: exact scaling


def build(arch: dict, seq_len: int) -> LlamaForCausalLM:
    """A randomly initialised fp32 LLaMA with `arch` on CPU."""
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(**arch, max_position_embeddings=seq_len, use_cache=False, tie_word_embeddings=False)
    )


def batch(seq_len: int, vocab: int) -> dict:
    """One row of 128-token documents back to back."""
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "position_ids": (torch.arange(seq_len) % DOC)[None]}


def prepare(memory: MemoryConfig, seq_len: int) -> LlamaForCausalLM:
    """The narrow model, patched for dense packed-document attention, under `memory`."""
    model = build(NARROW, seq_len)
    patch_attention(model, mode="packed_doc", backend="dense", dense_chunk=CHUNK)
    apply_memory_policy(model, block_memory_specs(memory, model.config.num_hidden_layers))
    return model.train()


def workload(seq_len: int, backend: AttnBackend = AttnBackend.DENSE) -> Workload:
    return Workload(1, seq_len, 4, backend, LOSS_CHUNK, doc_len=DOC, dense_chunk=CHUNK)


def measure_bytes(max_gib: float, measure_up_to: int) -> list[dict]:
    """Meter vs planner per (policy, length); measured only up to `measure_up_to` tokens and where the planner
    expects < max_gib on the host (the planner's columns cover every length)."""
    narrow, wide = (
        ModelShape.from_hf_config(build(NARROW, 8).config),
        ModelShape.from_hf_config(LlamaConfig(**DEEPSEEK_7B)),
    )
    rows = []
    for seq_len in LENGTHS:
        for label, memory in POLICIES.items():
            est = estimate_activations(narrow, workload(seq_len), memory_specs(memory, narrow))
            est_7b = estimate_activations(
                wide, Workload(1, seq_len, 2, AttnBackend.FLEX, LOSS_CHUNK), memory_specs(memory, wide)
            )
            row = {
                "policy": label,
                "seq_len": seq_len,
                "planner_bytes": est.total_bytes,
                "planner_offloaded_bytes": est.offloaded_bytes,
                "planner_7b_bf16_bytes": est_7b.total_bytes,
                "planner_7b_bf16_offloaded_bytes": est_7b.offloaded_bytes,
            }
            if seq_len <= measure_up_to and (est.total_bytes + est.offloaded_bytes) / GiB < max_gib:
                model = prepare(memory, seq_len)
                b = batch(seq_len, NARROW["vocab_size"])
                t0 = time.perf_counter()
                report, out = measure_activations(model, lambda m=model, b=b: forward_loss_sum(m, b, LOSS_CHUNK))
                del out
                row.update(
                    measured_bytes=report.total_bytes,
                    measured_offloaded_bytes=report.offloaded_bytes,
                    planner_error=est.total_bytes / report.total_bytes - 1,
                    forward_s=time.perf_counter() - t0,
                    # the 7B's bytes: measured at 1/64 width x the planner's 7B/narrow ratio
                    measured_scaled_7b_bf16_bytes=report.total_bytes * est_7b.total_bytes / est.total_bytes,
                )
                del model
                gc.collect()
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def tiled_overhead(seq_len: int, repeats: int) -> dict:
    """Forward+backward step time of full + tiled MLP vs full at seq_len (narrow width, tile 1024 so the
    row has several tiles), interleaved runs in one process; the ratio is what tiling costs on CPU."""
    models = {
        label: prepare(MemoryConfig(policy="full", tiled_mlp=tile), seq_len)
        for label, tile in (("untiled", 0), ("tiled", 1024))
    }
    b = batch(seq_len, NARROW["vocab_size"])
    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(repeats):
        for label, model in models.items():  # interleaved: machine load hits both alike
            t0 = time.perf_counter()
            forward_loss_sum(model, b, LOSS_CHUNK).backward()
            times[label].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    best = {label: min(t) for label, t in times.items()}
    return {
        "seq_len": seq_len,
        "tile": 1024,
        "repeats": repeats,
        "times_s": times,
        "best_s": best,
        "overhead_ratio": best["tiled"] / best["untiled"],
    }


def main() -> None:
    """Measure, print, and write bench/results/long_context.{json,md,png}."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-gib", type=float, default=3.0, help="skip measurements the planner puts above this")
    ap.add_argument("--measure-up-to", type=int, default=LENGTHS[-1], help="longest row the meter runs")
    ap.add_argument("--overhead-len", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = measure_bytes(args.max_gib, args.measure_up_to)
    overhead = tiled_overhead(args.overhead_len, args.repeats)
    measured = [r for r in rows if "measured_bytes" in r]
    result = {
        "torch": torch.__version__,
        "narrow": NARROW,
        "deepseek7b": DEEPSEEK_7B,
        "doc_len": DOC,
        "dense_chunk": CHUNK,
        "loss_chunk": LOSS_CHUNK,
        "rows": rows,
        "tiled_mlp_overhead": overhead,
        "worst_planner_error": max((abs(r["planner_error"]) for r in measured), default=None),
    }
    lines = [
        (
            "| policy | seq_len | measured (MiB, 1/64 width) | planner (MiB) | error | 7B bf16 (GiB, measured x "
            "ratio) | 7B bf16 planner (GiB) | 7B offloaded (GiB) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.get("measured_bytes")
        lines.append(
            f"| {r['policy']} | {r['seq_len']:,} | {m / 2**20:.1f} | "
            if m
            else f"| {r['policy']} | {r['seq_len']:,} | (not run) | "
        )
        lines[-1] += (
            f"{r['planner_bytes'] / 2**20:.1f} | "
            + (
                f"{100 * r['planner_error']:+.2f}% | {r['measured_scaled_7b_bf16_bytes'] / GiB:.2f} | "
                if m
                else "- | - | "
            )
            + f"{r['planner_7b_bf16_bytes'] / GiB:.2f} | {r['planner_7b_bf16_offloaded_bytes'] / GiB:.2f} |"
        )
    text = "\n".join(lines)
    o = overhead
    summary = (
        f"tiled MLP step-time overhead (full checkpointing, {o['seq_len']:,} tokens, tiles of {o['tile']}, "
        f"best of {o['repeats']} interleaved): {o['best_s']['tiled']:.2f} s vs {o['best_s']['untiled']:.2f} s = "
        f"x{o['overhead_ratio']:.3f}"
    )
    print(text + "\n\n" + summary)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "long_context.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "long_context.md").write_text(
        f"# Activation bytes at long rows (CPU, torch {torch.__version__})\n\n"
        "deepseek-llm-7b's 30 blocks at 1/64 width (hidden 64, 32 heads x 2, intermediate 172), fp32, 128-token "
        "documents back to back, dense attention in 128-query chunks, chunked loss (1024). Measured = bytes alive "
        "for backward after one forward (surgery/memory/meter.py; offloaded host copies apart). 7B columns: bf16, "
        f"flex attention. Not run: rows over {args.measure_up_to:,} tokens or over {args.max_gib:g} GiB on the host. "
        "The machine was shared with other jobs: forward times are not comparable.\n\n" + text + "\n\n" + summary + "\n"
    )
    plot(rows, RESULTS / "long_context.png")


def plot(rows: list[dict], path: Path) -> None:
    """7B-width bytes per policy vs seq_len: planner lines, measured-and-scaled points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, label in enumerate(POLICIES):
        mine = [r for r in rows if r["policy"] == label]
        ax.plot(
            [r["seq_len"] for r in mine],
            [r["planner_7b_bf16_bytes"] / GiB for r in mine],
            color=f"C{i}",
            label=f"{label} (planner)",
        )
        pts = [r for r in mine if "measured_bytes" in r]
        ax.scatter(
            [r["seq_len"] for r in pts],
            [r["measured_scaled_7b_bf16_bytes"] / GiB for r in pts],
            color=f"C{i}",
            marker="o",
        )
    ax.axhline(80, color="black", linestyle="--", label="80 GiB card")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("seq_len (tokens)")
    ax.set_ylabel("activation bytes on the device, deepseek-7B bf16 (GiB)")
    ax.set_title("lines: planner at 7B width; dots: measured at 1/64 width, scaled")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
