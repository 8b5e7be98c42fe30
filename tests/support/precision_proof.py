"""The precision proof's fine-tune, shared by the CPU test (tests/surgery/test_precision.py) and its CUDA twin
(tests/gpu/test_gpu_precision.py): a full-depth narrow LLaMA fine-tuned at lr 2e-5 from the same start on the
same batches under a precision mode, through flexengine's spec, optimizer and autocast.

Updates are compared with fp32's by the regression slope <Δ_mode, Δ_fp32> / <Δ_fp32, Δ_fp32> over all matrix
entries: ~1 when updates arrive (fp32 masters, or stochastic rounding in expectation), well below 1 when they
round away (pure bf16)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flexengine.core.config import OptimConfig
from flexengine.loop.optim import build_optimizer
from flexengine.surgery.precision import precision_spec
from tests.helpers import make_llama

CPU = torch.device("cpu")
LR = 2e-5  # the 7B experiments' fine-tuning rate: 2e-5 rounds away against bf16 weights of ~0.02
# 32 narrow blocks; every matrix [64, 64] or [128, 64] (few shapes: torchao compiles one step per shape)
NARROW = dict(
    num_hidden_layers=32,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
)


def learnable_batches(
    steps: int, vocab: int, seq: int = 64, batch: int = 4, device: torch.device = CPU
) -> list[torch.Tensor]:
    """A learnable stream (each token a fixed function of the previous one), the same for every mode."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        positions = torch.arange(seq)
        out.append(((start * 5 ** (positions % 7) + 3 * positions) % vocab).to(device))
    return out


def start_model(arch: dict = NARROW, device: torch.device = CPU) -> torch.nn.Module:
    """The common start: weights rounded to bf16 once, so every mode starts from exactly the same values."""
    model = make_llama(seed=0, attn_implementation="sdpa", **arch).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


@dataclass
class Finetune:
    """One mode's run: what it computed and how its weights moved."""

    model: torch.nn.Module
    losses: list[float]  # the training loss of each step, as the mode computes it
    delta: dict[str, torch.Tensor]  # final - initial weights per matrix, fp32
    step_deltas: list[dict[str, torch.Tensor]] = field(default_factory=list)  # each step's update (keep_steps)


def _matrices(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.ndim == 2}


def finetune(mode: str, batches: list[torch.Tensor], arch: dict = NARROW, keep_steps: bool = False) -> Finetune:
    """One AdamW step per batch under `mode` (flexengine's spec, optimizer and autocast), on the batches' device."""
    device = batches[0].device
    spec = precision_spec(mode)
    model = start_model(arch, device).to(spec.param_dtype).train()
    start = before = _matrices(model)
    opt = build_optimizer(model, OptimConfig(name=spec.optimizer, lr=LR, weight_decay=0.0), device)
    run = Finetune(model, [], {})
    for batch in batches:
        with spec.compute_context(device):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.losses.append(loss.item())
        if keep_steps:
            after = _matrices(model)
            run.step_deltas.append({n: after[n] - before[n] for n in after})
            before = after
    run.delta = {n: p - start[n] for n, p in _matrices(model).items()}
    return run


def loss_fp32(model: torch.nn.Module, batch: torch.Tensor, arch: dict = NARROW) -> float:
    """Loss of the model's weights in fp32 compute (the same yardstick for every mode)."""
    twin = start_model(arch, batch.device)
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        return twin(input_ids=batch, labels=batch).loss.item()


def update_slope(delta: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """<delta, ref> / <ref, ref> over all entries: the part of the reference update that arrived."""
    num = sum((delta[n] * ref[n]).sum() for n in ref)
    return float(num / sum((ref[n] * ref[n]).sum() for n in ref))


def agreement(
    run: Finetune, ref: Finetune, gain_ref: float, loss0: float, eval_batch: torch.Tensor, arch: dict = NARROW
) -> dict:
    """How closely `run` follows the fp32 reference `ref` (both with keep_steps): per step, the relative loss
    difference, the slope of its update on fp32's and their norm ratio; overall, the fp32-measured loss gain
    relative to fp32's and the fraction of matrix entries that never moved."""

    def norm(d: dict) -> float:
        return float(sum((v * v).sum() for v in d.values()) ** 0.5)

    entries = sum(d.numel() for d in run.delta.values())
    return {
        "loss_rel_diff": [abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses)],
        "step_slope": [update_slope(d, r) for d, r in zip(run.step_deltas, ref.step_deltas)],
        "step_norm_ratio": [norm(d) / norm(r) for d, r in zip(run.step_deltas, ref.step_deltas)],
        "gain": (loss0 - loss_fp32(run.model, eval_batch, arch)) / gain_ref,
        "unchanged": sum(int((d == 0).sum()) for d in run.delta.values()) / entries,
    }
