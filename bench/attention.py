"""Attention benchmark (CPU): BlockMask build time, block sparsity, and packed vs padded useful tokens/s.

    python bench/attention.py [--quick]

Writes bench/results/attention.json, .md and .png.
1. Build time of the per-batch BlockMask vs sequence length and document count: flexengine's block-level builder
   vs torch's `create_block_mask` (eager on CPU; it evaluates the mask per element, so it is only run where it
   finishes in reasonable time).
2. Block sparsity (fraction of a causal mask's blocks computed) vs document length mix.
3. Useful tokens/s of `attn=packed_doc` (bfd packing, dense reference backend on CPU) vs the padded baseline
   `attn=causal` (one document per row, HF SDPA) on the demo corpus: same model, same steps, one process.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flexengine.attention.block_mask import _create_block_mask, build_batch_mask, canonical_document_ids
from flexengine.attention.masks import get_mask_mod
from flexengine.attention.spec import AttnBackend
from flexengine.config import AttnMode

RESULTS = Path(__file__).parent / "results"
TORCH_BUILDER_MAX_S = 32768  # eager create_block_mask on CPU: ~1 s at 8K, ~40 s at 32K, minutes beyond


def _doc_layout(seq_len: int, mean_len: int, rng: np.random.Generator) -> torch.Tensor:
    lengths, total = [], 0
    while total < seq_len:
        n = int(min(max(1, rng.lognormal(np.log(mean_len), 0.8)), seq_len - total))
        lengths.append(n)
        total += n
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def bench_mask_build(seq_lens: list[int], mean_lens: list[int]) -> list[dict]:
    """Median build time (s) of one row's packed_doc BlockMask, both builders."""
    rng = np.random.default_rng(0)
    rows = []
    for seq_len in seq_lens:
        for mean_len in mean_lens:
            doc = canonical_document_ids(_doc_layout(seq_len, mean_len, rng)[None])
            ours = _timed(lambda doc=doc: build_batch_mask(doc, documents=True, window=None, backend=AttnBackend.FLEX))
            row = {"seq_len": seq_len, "mean_doc_len": mean_len, "documents": int(doc.max()) + 1,
                   "flexengine_s": ours, "torch_create_block_mask_s": None}
            if seq_len <= TORCH_BUILDER_MAX_S:
                mod = get_mask_mod(doc)
                row["torch_create_block_mask_s"] = _timed(
                    lambda mod=mod, seq_len=seq_len, doc=doc: _create_block_mask(mod, 1, seq_len, doc.device, 128), 1)
            rows.append(row)
            theirs = row["torch_create_block_mask_s"]
            print(f"mask build S={seq_len:>6} docs={row['documents']:>4}: flexengine {ours * 1e3:8.1f} ms  "
                  f"torch {theirs if theirs is None else round(theirs * 1e3, 1)} ms")
    return rows


def bench_sparsity(seq_len: int, mean_lens: list[int], window: int) -> list[dict]:
    """Block sparsity for packed_doc and packed_sliding at several document length mixes."""
    rng = np.random.default_rng(1)
    rows = []
    for mean_len in mean_lens:
        doc = torch.stack([_doc_layout(seq_len, mean_len, rng) for _ in range(4)])
        row = {"seq_len": seq_len, "mean_doc_len": mean_len}
        for mode in ("causal", "packed_doc", "sliding_window", "packed_sliding"):
            m = AttnMode(mode)
            mask = build_batch_mask(doc, documents=m.documents, window=window if m.windowed else None,
                                    backend=AttnBackend.FLEX)
            row[mode] = float(mask.block_density)
        rows.append(row)
        print(f"sparsity S={seq_len} mean doc {mean_len:>5}: " + " ".join(f"{m}={row[m]:.3f}" for m in
                                                                          ("packed_doc", "packed_sliding")))
    return rows


def bench_throughput(steps: int, seq_len: int, micro_batch: int) -> dict:
    """Useful tokens/s, packed_doc vs the padded causal baseline, same model and number of steps."""
    from flexengine.cli import compose_job
    from flexengine.run import run_training

    results = {}
    for attn in ("causal", "packed_doc"):
        with tempfile.TemporaryDirectory() as out:
            job = compose_job([
                f"attn={attn}", f"data.seq_len={seq_len}", f"train.max_steps={steps}",
                f"train.micro_batch={micro_batch}", "train.grad_accum=1", "train.save_final=false",
                "train.progress=false", f"train.output_dir={out}",
            ])
            s = run_training(job, Path(out))
        results[attn] = {k: s[k] for k in ("useful_tokens_per_s", "tokens_per_s", "useful_token_fraction",
                                           "wall_s", "final_loss", "useful_tokens_seen", "block_density")}
        print(f"{attn:>10}: {s['useful_tokens_per_s']:8.0f} useful tok/s, useful fraction "
              f"{s['useful_token_fraction']:.3f}, {s['wall_s']:.1f} s")
    results["speedup_useful_tokens_per_s"] = (
        results["packed_doc"]["useful_tokens_per_s"] / results["causal"]["useful_tokens_per_s"]
    )
    print(f"packed_doc / causal useful tokens/s: {results['speedup_useful_tokens_per_s']:.2f}x")
    return results


def write_outputs(report: dict) -> None:
    """JSON + Markdown + PNG under bench/results/."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attention.json").write_text(json.dumps(report, indent=2))
    lines = ["# Attention benchmark (CPU)", "", f"torch {torch.__version__}, {report['cpu_threads']} CPU threads", "",
             "## BlockMask build time (one row, packed_doc)", "",
             "| seq_len | documents | flexengine block-level (ms) | torch create_block_mask eager (ms) |",
             "|---|---|---|---|"]
    for r in report["mask_build"]:
        theirs = r["torch_create_block_mask_s"]
        torch_ms = "not run (too slow on CPU)" if theirs is None else f"{theirs * 1e3:.1f}"
        lines.append(f"| {r['seq_len']} | {r['documents']} | {r['flexengine_s'] * 1e3:.1f} | {torch_ms} |")
    lines += ["", f"## Block sparsity (fraction of causal blocks computed, window {report['window']})", "",
              "| seq_len | mean doc len | causal | packed_doc | sliding_window | packed_sliding |",
              "|---|---|---|---|---|---|"]
    for r in report["sparsity"]:
        lines.append(f"| {r['seq_len']} | {r['mean_doc_len']} | {r['causal']:.3f} | {r['packed_doc']:.3f} | "
                     f"{r['sliding_window']:.3f} | {r['packed_sliding']:.3f} |")
    t = report.get("throughput")
    if t:
        lines += ["", (f"## Useful tokens/s on the demo corpus (tiny LLaMA, seq_len {report['throughput_seq_len']}, "
                       f"micro_batch {report['throughput_micro_batch']}, {report['throughput_steps']} steps each; "
                       "causal = one document per row padded to the batch's longest, HF SDPA; packed_doc = bfd rows, "
                       "dense chunked reference backend (FlexAttention has no CPU backward))"), "",
                  "| attn | useful tok/s | tok/s | useful fraction | final loss |", "|---|---|---|---|---|"]
        for attn in ("causal", "packed_doc"):
            r = t[attn]
            lines.append(f"| {attn} | {r['useful_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
                         f"{r['useful_token_fraction']:.3f} | {r['final_loss']:.3f} |")
        speedup = t["speedup_useful_tokens_per_s"]
        lines += ["", f"**packed_doc / causal useful tokens/s: {speedup:.2f}x** (target >= 2x)"]
    (RESULTS / "attention.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    by_len: dict = {}
    for r in report["mask_build"]:
        by_len.setdefault(r["seq_len"], []).append(r)
    xs = sorted(by_len)
    ax[0].plot(xs, [np.median([r["flexengine_s"] for r in by_len[x]]) * 1e3 for x in xs], "o-", label="flexengine")
    tx = [x for x in xs if all(r["torch_create_block_mask_s"] is not None for r in by_len[x])]
    ax[0].plot(tx, [np.median([r["torch_create_block_mask_s"] for r in by_len[x]]) * 1e3 for x in tx], "s-",
               label="torch create_block_mask (eager)")
    ax[0].set(xscale="log", yscale="log", xlabel="sequence length", ylabel="build time per row (ms)",
              title="BlockMask build (CPU)")
    ax[0].legend()
    sp = report["sparsity"]
    for mode in ("packed_doc", "packed_sliding", "sliding_window"):
        ax[1].plot([r["mean_doc_len"] for r in sp], [r[mode] for r in sp], "o-", label=mode)
    ax[1].set(xscale="log", xlabel="mean document length", ylabel="blocks computed / causal blocks",
              title=f"Block sparsity at S={sp[0]['seq_len']}")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "attention.png", dpi=110)


def main() -> None:
    """Run all three parts and write the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller grid, no throughput run")
    # the forum case in miniature: long rows, several long-tailed documents per padded batch
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    seq_lens = [8192, 32768] if args.quick else [8192, 32768, 131072]
    report = {
        "cpu_threads": torch.get_num_threads(), "window": 1024,
        "mask_build": bench_mask_build(seq_lens, [512, 2048, 8192]),
        "sparsity": bench_sparsity(32768, [256, 1024, 4096, 16384], window=1024),
    }
    if not args.quick:
        report["throughput_steps"], report["throughput_seq_len"] = args.steps, args.seq_len
        report["throughput_micro_batch"] = args.micro_batch
        report["throughput"] = bench_throughput(args.steps, args.seq_len, args.micro_batch)
    write_outputs(report)


if __name__ == "__main__":
    main()
