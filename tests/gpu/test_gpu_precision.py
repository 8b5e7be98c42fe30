"""The precision proof on CUDA: a 32-layer LLaMA of hidden 256 fine-tuned at lr 2e-5 under
precision=bf16_mixed (fp32 masters, bf16 autocast) follows precision=fp32 on the same batches, step by step, and
precision=bf16_pure, whose updates round away against its bf16 weights, fails the same check. The CPU twin
(tests/surgery/test_precision.py) runs bf16 autocast on the CPU; this one runs CUDA's bf16 kernels and fused AdamW."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.precision_proof import agreement, finetune, learnable_batches, loss_fp32, start_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WIDE = dict(
    num_hidden_layers=32,
    hidden_size=256,
    intermediate_size=688,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=512,
)
STEPS = 12
# Tolerances. Measured at this shape and these batches with the CPU's bf16 autocast (this file's check run on
# the CPU, 66 s): bf16_mixed: step losses within 0.03 % of fp32's, per-step update slope 0.994-1.000, norm
# ratio 1.000, loss gain 1.001, 0.002 % of entries never moved; bf16_pure: slope 0.37 falling to 0.16, norm ratio
# 0.69 -> 0.46, gain 0.40, 71 % never moved (bf16 weights of ~0.02 have a half-ulp of ~6e-5 > lr 2e-5).
LOSS_RTOL = 0.01  # per step, relative: bf16 compute noise (pure bf16's loss stays within it too: 0.8 % at most)
UPDATE_RANGE = (0.9, 1.1)  # per-step slope and norm ratio, and the fp32-measured loss gain, vs fp32


def failures(r: dict) -> list[str]:
    """What a run's agreement with fp32 breaks (empty: it agrees within the stated tolerances)."""
    lo, hi = UPDATE_RANGE
    out = [f"step {t}: loss differs by {d:.2%}" for t, d in enumerate(r["loss_rel_diff"]) if d > LOSS_RTOL]
    out += [f"step {t}: update slope {s:.3f}" for t, s in enumerate(r["step_slope"]) if not lo < s < hi]
    out += [f"step {t}: update norm ratio {s:.3f}" for t, s in enumerate(r["step_norm_ratio"]) if not lo < s < hi]
    out += [f"loss gain {r['gain']:.3f} of fp32's"] if not lo < r["gain"] < hi else []
    return out


def test_bf16_mixed_follows_fp32_and_bf16_pure_does_not():
    torch.manual_seed(0)
    batches = learnable_batches(STEPS, WIDE["vocab_size"], device=torch.device("cuda"))
    ref = finetune("fp32", batches, WIDE, keep_steps=True)
    eval_batch = batches[0]
    loss0 = loss_fp32(start_model(WIDE, eval_batch.device), eval_batch, WIDE)
    gain_ref = loss0 - loss_fp32(ref.model, eval_batch, WIDE)
    assert gain_ref > 0, f"fp32 did not learn in {STEPS} steps: loss {loss0:.4f} -> {loss0 - gain_ref:.4f}"
    results = {}
    for mode in ("bf16_mixed", "bf16_pure"):
        run = finetune(mode, batches, WIDE, keep_steps=True)
        results[mode] = agreement(run, ref, gain_ref, loss0, eval_batch, WIDE)
        del run
        torch.cuda.empty_cache()
    summary = {
        "check": "precision_vs_fp32",
        "steps": STEPS,
        "lr": 2e-5,
        "fp32_losses": ref.losses,
        "fp32_gain": gain_ref,
        "loss_rtol": LOSS_RTOL,
        "update_range": UPDATE_RANGE,
    }
    for mode, r in results.items():
        summary[mode] = {
            "max_loss_rel_diff": max(r["loss_rel_diff"]),
            "min_step_slope": min(r["step_slope"]),
            "mean_step_slope": sum(r["step_slope"]) / STEPS,
            "step_norm_ratio": [min(r["step_norm_ratio"]), max(r["step_norm_ratio"])],
            "gain": r["gain"],
            "unchanged": r["unchanged"],
            "failures": failures(r)[:6],
        }
    print(json.dumps(summary))  # one line: bench/gpu_check.py puts it into gpu_check.json
    assert not failures(results["bf16_mixed"]), failures(results["bf16_mixed"])
    assert failures(results["bf16_pure"]), "bf16_pure passed the check meant to catch it: the check is too loose"
