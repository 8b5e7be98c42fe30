"""Precision proof on CPU: a 32-layer narrow LLaMA fine-tuned at lr 2e-5 from the same start on the same batches
under each precision mode, against fp32. The cumulative update Δ = final - initial over all matrix entries is
compared by the regression slope <Δ_mode, Δ_fp32> / <Δ_fp32, Δ_fp32>: ~1 when updates arrive (fp32 masters, or
stochastic rounding in expectation), well below 1 when they round away (pure bf16)."""

from __future__ import annotations

import pytest
import torch

from flexengine.config import OptimConfig
from flexengine.optim import build_optimizer
from flexengine.precision import SPECS, autocast_context, precision_spec
from tests.helpers import make_llama

CPU = torch.device("cpu")
LR, STEPS, VOCAB, SEQ, BATCH = 2e-5, 12, 128, 64, 4


def _batches() -> list[torch.Tensor]:
    """A learnable stream (each token a fixed function of the previous one), the same for every mode."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        steps = torch.arange(SEQ)
        out.append((start * 5 ** (steps % 7) + 3 * steps) % VOCAB)
    return out


def _start_model():
    """32 narrow blocks; every matrix [64, 64] or [128, 64] (few shapes: torchao compiles one step per shape).
    Weights rounded to bf16 once, so every mode starts from exactly the same values."""
    model = make_llama(seed=0, num_hidden_layers=32, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=VOCAB, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _loss_fp32(model, batch: torch.Tensor) -> float:
    """Loss of the weights in fp32 compute (the same yardstick for every mode)."""
    twin = _start_model()
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return twin(input_ids=batch, labels=batch).loss.item()


def finetune(mode: str) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """STEPS AdamW steps under `mode` (flexengine's spec, optimizer and autocast); returns Δ per matrix."""
    spec = precision_spec(mode)
    model = _start_model().to(spec.param_dtype).train()
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(name=spec.optimizer, lr=LR, weight_decay=0.0), CPU)
    for batch in _batches():
        with autocast_context(spec, CPU):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    delta = {n: p.detach().float() - start[n] for n, p in model.named_parameters() if p.ndim == 2}
    return delta, model


def _slope(delta: dict, ref: dict) -> float:
    num = sum((delta[n] * ref[n]).sum() for n in ref)
    return float(num / sum((ref[n] * ref[n]).sum() for n in ref))


@pytest.mark.slow
def test_every_mode_but_pure_bf16_delivers_the_fp32_update():
    ref, ref_model = finetune("fp32")
    eval_batch = _batches()[0]
    loss0 = _loss_fp32(_start_model(), eval_batch)
    gain_fp32 = loss0 - _loss_fp32(ref_model, eval_batch)
    assert gain_fp32 > 0
    results = {}
    for mode in [m for m in SPECS if m != "fp32"]:
        delta, model = finetune(mode)
        unchanged = sum(int((d == 0).sum()) for d in delta.values()) / sum(d.numel() for d in delta.values())
        results[mode] = {"slope": _slope(delta, ref), "gain": (loss0 - _loss_fp32(model, eval_batch)) / gain_fp32,
                         "unchanged": unchanged}
    print(results)
    # Measured (torch 2.13 CPU, torchao 0.18): slope / gain / entries unchanged
    #   bf16_mixed 0.999 / 1.002 / 0.0 %   bf16_cpu_master 0.971 / 0.968 / 35 % (device copy of the masters)
    #   bf16_sr    0.999 / 0.994 / 32 %    bf16_pure       0.251 / 0.295 / 71 %
    for mode, r in results.items():
        if mode == "bf16_pure":  # the mode this test exists to catch
            assert r["slope"] < 0.5 and r["gain"] < 0.5, r
        else:
            assert 0.9 < r["slope"] < 1.1 and 0.9 < r["gain"] < 1.1, (mode, r)
