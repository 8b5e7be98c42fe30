"""What a seq_len and packing strategy cost, before any GPU hour is spent.

    python -m flexengine.stats data=jsonl data.path=/data/train.jsonl data.seq_len=8192

Tokenizes (or loads the cached corpus exactly as training would), prints the document-length percentiles and,
for bfd / greedy / none, rows, useful-token fraction and long-document counts; writes data_stats.json and a
length histogram data_stats.png into the Hydra run directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from flexengine.data.loader import batch_useful_fraction, epoch_order, row_token_counts
from flexengine.data.packing import plan_packing

PERCENTILES = (0, 10, 25, 50, 75, 90, 95, 99, 100)
STRATEGIES = ("bfd", "greedy", "none")


def length_summary(lengths: np.ndarray) -> dict:
    """Count, total, mean and percentiles of document lengths in tokens."""
    lengths = np.asarray(lengths)
    summary = {"documents": len(lengths), "tokens": int(lengths.sum()), "mean": float(lengths.mean())}
    summary.update({f"p{q}": int(v) for q, v in zip(PERCENTILES, np.percentile(lengths, PERCENTILES, method="lower"))})
    return summary


def context_summary(lengths: np.ndarray, trained: int, supported: int) -> dict:
    """Where the document lengths fall against the model's trained and (RoPE-scaled) supported context."""
    lengths = np.asarray(lengths)
    over = lengths > trained
    return {
        "trained_context": int(trained),
        "supported_context": int(supported),
        "documents_within_trained": float(1.0 - over.mean()) if len(lengths) else 1.0,
        "documents_over_trained": int(over.sum()),
        "documents_over_supported": int((lengths > supported).sum()),
        "tokens_past_trained": int(np.clip(lengths - trained, 0, None).sum()),
    }


def format_context(summary: dict, context: dict, describe: str) -> str:
    """One paragraph: the length percentiles against the trained/supported context."""
    marks = "  ".join(
        f"p{q}={summary[f'p{q}']}{'*' if summary[f'p{q}'] > context['trained_context'] else ''}"
        for q in PERCENTILES
        if q >= 50
    )
    return (
        f"context: model {describe}\n"
        f"  {100 * context['documents_within_trained']:.1f}% of documents within {context['trained_context']} "
        f"positions; {context['documents_over_trained']} longer "
        f"({context['tokens_past_trained']:,} tokens past it), "
        f"{context['documents_over_supported']} longer than the supported {context['supported_context']}\n"
        f"  {marks}   (* = past the trained context)"
    )


def compare_strategies(
    lengths: np.ndarray, seq_len: int, long_docs: str = "split", micro_batch: int = 1, seed: int = 0
) -> list[dict]:
    """Plan every packing strategy on these lengths: PackStats + pack time per strategy.

    For `none` (one document per row) `useful_token_fraction` counts rows padded to seq_len, while
    `batched_useful_fraction` / `bucketed_useful_fraction` count what training computes when each batch of
    micro_batch rows is cut to its longest row (random order / with data.bucket=true).
    """
    results = []
    for strategy in STRATEGIES:
        start = time.perf_counter()
        plan = plan_packing(lengths, seq_len, strategy, long_docs)
        result = {"strategy": strategy, "pack_s": time.perf_counter() - start, **plan.stats.as_dict()}
        if strategy == "none" and plan.stats.rows >= micro_batch:
            row_tokens = row_token_counts(plan)
            for name, bucket in (("batched_useful_fraction", False), ("bucketed_useful_fraction", True)):
                order = epoch_order(row_tokens, seed=seed, epoch=0, micro_batch=micro_batch, bucket=bucket)
                result[name] = batch_useful_fraction(row_tokens, order, micro_batch, seq_len, trim_padding=True)
        results.append(result)
    return results


def format_report(summary: dict, strategies: list[dict], seq_len: int, micro_batch: int) -> str:
    """Human-readable tables of length_summary and compare_strategies."""
    lines = [
        f"{summary['documents']} documents, {summary['tokens']:,} tokens, mean {summary['mean']:.0f} tokens",
        "length percentiles: " + "  ".join(f"p{q}={summary[f'p{q}']}" for q in PERCENTILES),
        "",
        f"seq_len={seq_len}   strategy  rows    useful   docs/row  split  truncated  dropped  pack_s",
    ]
    for r in strategies:
        lines.append(
            f"{'':16}{r['strategy']:<9} {r['rows']:<7} {100 * r['useful_token_fraction']:6.2f}%  "
            f"{r['documents_per_row']:8.2f}  {r['documents_split']:<6} {r['documents_truncated']:<10} "
            f"{r['documents_dropped']:<8} {r['pack_s']:.3f}"
        )
        if "batched_useful_fraction" in r:
            lines.append(
                f"{'':26}(none, batches of {micro_batch} cut to their longest row: "
                f"{100 * r['batched_useful_fraction']:.2f}% useful, {100 * r['bucketed_useful_fraction']:.2f}% "
                "with data.bucket=true)"
            )
    return "\n".join(lines)


def plot_length_histogram(lengths: np.ndarray, seq_len: int, path: Path) -> None:
    """Log-x histogram of document lengths with seq_len marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = np.asarray(lengths)
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.logspace(np.log10(max(1, lengths.min())), np.log10(lengths.max() + 1), 50)
    ax.hist(lengths, bins=bins.tolist(), color="tab:blue")
    ax.axvline(seq_len, color="tab:red", linestyle="--", label=f"seq_len={seq_len}")
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(f"{len(lengths)} documents, {int(lengths.sum()):,} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
