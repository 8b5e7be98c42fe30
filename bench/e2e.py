"""End-to-end grid on CPU: attention mode x memory policy, each a real `python -m flexengine.train` run.

Each run is its own process (so its peak RSS is its own) on the tiny model and demo corpus
(experiment=cpu_compare). Reports tokens/s, useful tokens/s, peak memory and loss; writes
bench/results/e2e.{json,md,png}. Usage: python bench/e2e.py [--steps N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
ATTN = ("causal", "packed_doc", "packed_sliding")
MEMORY = ("none", "full")


def run_one(attn: str, memory: str, steps: int, work: Path) -> dict:
    """One training run in a fresh process; its summary.json (or the error)."""
    out = work / f"{attn}-{memory}"
    cmd = [
        sys.executable,
        "-m",
        "flexengine.train",
        "experiment=cpu_compare",
        f"attn={attn}",
        f"memory={memory}",
        f"train.max_steps={steps}",
        f"hydra.run.dir={out}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    row = {"attn": attn, "memory": memory, "process_s": time.perf_counter() - t0}
    if proc.returncode != 0:
        stderr = proc.stderr.strip()
        return {**row, "error": stderr.splitlines()[-1] if stderr else f"rc {proc.returncode}"}
    s = json.loads((out / "summary.json").read_text())
    return {
        **row,
        "tokens_per_s": s["tokens_per_s"],
        "useful_tokens_per_s": s["useful_tokens_per_s"],
        "useful_token_fraction": s["useful_token_fraction"],
        "peak_rss_gib": s["peak_memory_bytes"] / 2**30,
        "block_density": s["block_density"],
        "initial_loss": s["initial_loss"],
        "final_loss": s["final_loss"],
        "backend": s["attention"]["backend"],
        "steps": s["steps"],
        "wall_s": s["wall_s"],
    }


def write_results(rows: list[dict], steps: int) -> None:
    """JSON + Markdown table + bar chart."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "steps": steps,
        "experiment": "cpu_compare",
        "note": "CPU, tiny LLaMA (4M), demo corpus, seq_len 512, "
        "micro_batch 2; peak memory is process peak RSS (weights, data and interpreter included)",
    }
    (RESULTS / "e2e.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    cols = (
        "attn",
        "memory",
        "backend",
        "useful_tokens_per_s",
        "tokens_per_s",
        "useful_token_fraction",
        "block_density",
        "peak_rss_gib",
        "final_loss",
    )
    lines = [
        f"# e2e grid ({meta['note']}, {steps} steps)",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = [("ERROR: " + r["error"]) if "error" in r and c == "backend" else r.get(c) for c in cols]
        lines.append(
            "| "
            + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v if v is not None else "—") for v in cells)
            + " |"
        )
    (RESULTS / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    labels = [f"{r['attn']}\n{r['memory']}" for r in rows]
    colors = ["tab:orange" if r["attn"] == "causal" else "tab:blue" for r in rows]
    for ax, key, title in (
        (axes[0], "useful_tokens_per_s", "useful tokens/s"),
        (axes[1], "peak_rss_gib", "peak RSS (GiB)"),
    ):
        ax.bar(range(len(rows)), [r.get(key) or 0 for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(title)
    fig.suptitle("flexengine e2e on CPU: attention mode x memory policy")
    fig.tight_layout()
    fig.savefig(RESULTS / "e2e.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        rows = []
        for attn, memory in itertools.product(ATTN, MEMORY):
            rows.append(run_one(attn, memory, args.steps, Path(work)))
            print(f"{attn:>15} {memory:>5}: {rows[-1].get('useful_tokens_per_s', rows[-1].get('error'))}", flush=True)
    write_results(rows, args.steps)


if __name__ == "__main__":
    main()
