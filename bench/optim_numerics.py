"""Long-horizon optimizer numerics: each precision mode's optimizer against fp32 AdamW over 3,000 steps of a
halving gradient scale, at beta2 0.95 and 0.999 (tests/support/optim_numerics.py; the CI test is
tests/loop/test_optim_numerics.py).

    .venv/bin/python bench/optim_numerics.py

Rows: every concrete precision mode with the optimizer it builds, fp32 + adamw_8bit (torchao's compiled 8-bit step),
"bf16_sr, bf16 exp_avg_sq": torchao's own state storage, which adamw_bf16 used before it kept exp_avg_sq in fp32,
and "both states bf16 + SR": the measured alternative (stochastic rounding of the states too; 4 B/param, but its
own step function). Ratio = the mode's mean |step| over the last 500 steps / fp32 AdamW's on the same gradients;
the band is 0.9-1.1. Writes bench/results/optim_numerics.{json,md,png} (the png: the ratio over the run, 100-step
means).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from flexengine.surgery.precision import SPECS, precision_spec
from tests.support.optim_numerics import BETA2S, GRAD_SCALE, LR, RATIO_BAND, Horizon, mean, step_sizes, within_band

RESULTS = Path(__file__).resolve().parent / "results"
WINDOW = 100  # steps per point of the plotted curve


@contextlib.contextmanager
def bf16_second_moment():
    """adamw_bf16 as it was: torchao's own buffers (exp_avg_sq in bf16, round-to-nearest)."""
    from torchao.optim import _AdamW

    from flexengine.loop.adamw_bf16 import AdamWBF16

    with mock.patch.object(AdamWBF16, "_new_buffer", _AdamW._new_buffer):
        yield


def _sr_states_adam(p, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, weight_decay, eps, *flags):
    """torchao's single_param_adam (AdamW, no amsgrad) with both bf16 states stochastically rounded too."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    p_f32 = p.float()
    p_f32 = p_f32 - lr * weight_decay * p_f32
    m = exp_avg.float().lerp(grad.float(), 1 - beta1)
    v = exp_avg_sq.float().lerp(grad.float().square(), 1 - beta2)
    exp_avg.copy_(_fp32_to_bf16_sr(m))
    exp_avg_sq.copy_(_fp32_to_bf16_sr(v))
    p_f32 = p_f32 - lr * (m / (1 - beta1**step)) / (v.sqrt() / (1 - beta2**step).sqrt() + eps)
    p.copy_(_fp32_to_bf16_sr(p_f32))


@contextlib.contextmanager
def sr_states():
    """The alternative to an fp32 exp_avg_sq: both states bf16, stochastically rounded (4 B/param, not 6)."""
    import torchao.optim.adam as ao_adam

    with bf16_second_moment(), mock.patch.object(ao_adam, "single_param_adam", _sr_states_adam):
        yield


# (label, precision mode, optim.name, context, eager)
ROWS = [(mode, mode, "adamw", contextlib.nullcontext, True) for mode in SPECS] + [
    ("fp32 + adamw_8bit", "fp32", "adamw_8bit", contextlib.nullcontext, False),  # eager 8-bit: ~0.1 s a step
    ("bf16_sr, bf16 exp_avg_sq (before)", "bf16_sr", "adamw", bf16_second_moment, True),
    ("bf16_sr, both states bf16 + SR (not chosen)", "bf16_sr", "adamw", sr_states, True),
]


def curve(sizes: list[float]) -> list[float]:
    """Means over consecutive WINDOW-step windows."""
    return [mean(sizes[i : i + WINDOW]) for i in range(0, len(sizes) - WINDOW + 1, WINDOW)]


def run() -> dict:
    """Every row at every beta2: the tail ratio and the windowed ratio curve."""
    base = Horizon()
    results = {"steps": base.steps, "tail": base.tail, "lr": LR, "grad_scale": GRAD_SCALE, "band": RATIO_BAND}
    results["torch"], results["rows"] = torch.__version__, []
    for beta2 in BETA2S:
        reference = step_sizes(precision_spec("fp32"), beta2, Horizon(tail=base.steps))
        ref_tail, ref_curve = mean(reference[-base.tail :]), curve(reference)
        for label, mode, optimizer, context, eager in ROWS:
            spec = precision_spec(mode, optimizer)
            start = time.perf_counter()
            with context():
                sizes = step_sizes(spec, beta2, Horizon(tail=base.steps, eager=eager))
            ratio = mean(sizes[-base.tail :]) / ref_tail
            row = {
                "label": label,
                "precision": mode,
                "optimizer": spec.optimizer,
                "beta2": beta2,
                "ratio": ratio,
                "passes": within_band(ratio),
                "trains_correctly": spec.trains_correctly if label == mode or optimizer != "adamw" else None,
                "curve": [a / b for a, b in zip(curve(sizes), ref_curve)],
                "seconds": time.perf_counter() - start,
            }
            results["rows"].append(row)
            print(f"{label:<36} beta2={beta2}: {ratio:.3f}x fp32 AdamW ({row['seconds']:.0f} s)", flush=True)
    return results


def table(results: dict) -> str:
    """Markdown: label -> ratio at each beta2, and whether the mode claims to train correctly."""
    lines = [
        "# Long-horizon optimizer numerics (CPU, torch " + results["torch"] + ")",
        "",
        (
            f"Each mode's optimizer (built by flexengine.loop.optim) for {results['steps']:,} steps at lr "
            f"{results['lr']:g} on a 96x64 N(0, 0.02) matrix and a norm weight at 1.0; gradients = scale x (fixed "
            f"direction + noise), the scale halving over the run from {results['grad_scale']:g}. Ratio = mean |step| "
            f"over the last {results['tail']} steps / fp32 AdamW's; passes within {results['band'][0]}-"
            f"{results['band'][1]}. Steps are measured on the values the optimizer updates (the host fp32 masters "
            "for bf16_cpu_master)."
        ),
        "",
        "| mode | optimizer | ratio beta2 0.95 | ratio beta2 0.999 | passes | PrecisionSpec.trains_correctly |",
        "|---|---|---|---|---|---|",
    ]
    labels = list(dict.fromkeys(r["label"] for r in results["rows"]))
    for label in labels:
        rows = {r["beta2"]: r for r in results["rows"] if r["label"] == label}
        claim = next(iter(rows.values()))["trains_correctly"]
        passes = all(r["passes"] for r in rows.values())
        lines.append(
            f"| {label} | {next(iter(rows.values()))['optimizer']} | "
            + " | ".join(f"{rows[b]['ratio']:.3f}" for b in BETA2S)
            + f" | {'yes' if passes else 'no'} | {'-' if claim is None else claim} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """The windowed step ratio over the run, one panel per beta2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BETA2S), figsize=(12, 4.5), sharey=True)
    for ax, beta2 in zip(axes, BETA2S):
        for r in (r for r in results["rows"] if r["beta2"] == beta2):
            steps = [WINDOW * (i + 1) for i in range(len(r["curve"]))]
            ax.plot(steps, r["curve"], label=r["label"])
        ax.axhspan(*results["band"], color="green", alpha=0.1)
        ax.set_title(f"beta2 = {beta2}")
        ax.set_xlabel("step")
        ax.set_ylim(0.0, 1.3)
    axes[0].set_ylabel(f"mean |step| / fp32 AdamW's ({WINDOW}-step windows)")
    axes[-1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    results = run()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "optim_numerics.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    (RESULTS / "optim_numerics.md").write_text(text)
    plot(results, RESULTS / "optim_numerics.png")
    print(text)


if __name__ == "__main__":
    main()
