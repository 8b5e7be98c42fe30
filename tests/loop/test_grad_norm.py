"""The global gradient norm in fp32 under bf16 gradients: the value each bf16 mode logs and clips with (torch's
get_total_norm returns a bf16 number there: 2.828125 where fp32 says 2.8323)."""

from __future__ import annotations

import pytest
import torch

from flexengine.core.config import OptimConfig
from flexengine.loop.grad_norm import total_norm
from flexengine.loop.host_adamw import CPUOffloadAdamW
from flexengine.loop.optim import build_optimizer, clip_gradients
from flexengine.run import build_trainer
from flexengine.surgery.precision import SPECS
from tests.helpers import DEBUG_FAST, make_job, make_llama

CPU = torch.device("cpu")
BF16_MODES = ("bf16_sr", "bf16_cpu_master", "bf16_pure")  # the modes whose gradients are stored in bf16


def _exact_norm(grads) -> float:
    return torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()


def _bf16_grads(params, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=gen) * 1e-3).to(torch.bfloat16) for p in params]


def test_total_norm_of_bf16_gradients_is_their_fp32_norm():
    grads = _bf16_grads([torch.empty(300, 70), torch.empty(70), torch.empty(4096)])
    exact = _exact_norm(grads)
    bf16 = torch.nn.utils.get_total_norm(grads)
    assert bf16.dtype == torch.bfloat16 and abs(bf16.item() / exact - 1) > 1e-3  # the trap is there
    norm = total_norm(grads)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(exact, rel=1e-5)  # fp32 accuracy
    # fp32 gradients: the same numbers as torch's own norm, bit for bit
    fp32 = [g.float() for g in grads]
    assert torch.equal(total_norm(fp32), torch.nn.utils.get_total_norm(fp32))
    assert total_norm([]).item() == 0.0


@pytest.mark.parametrize("mode", BF16_MODES)
def test_each_bf16_mode_clips_with_the_fp32_norm(mode):
    """clip_gradients with the optimizer each mode builds: the norm returned (the one logged) is the fp32 norm, and
    the clip scales by max_norm / fp32 norm, on the device grads or, for the host optimizer, in its step."""
    model = make_llama().to(torch.bfloat16).train()
    params = list(model.parameters())
    # lr 1 and eps 1: AdamW's first update is then about lr * grad, so the clip coefficient shows in the masters
    cfg = OptimConfig(name=SPECS[mode].optimizer, lr=1.0, eps=1.0, weight_decay=0.0)
    opt = build_optimizer(model, cfg, CPU)
    grads = _bf16_grads(params)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    exact, max_norm = _exact_norm(grads), 0.5 * _exact_norm(grads)
    assert abs(torch.nn.utils.get_total_norm(grads).item() / exact - 1) > 1e-4  # bf16 would be off
    norm = clip_gradients(opt, params, max_norm)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(exact, rel=1e-5)
    if not isinstance(opt, CPUOffloadAdamW):  # clipped in place, by torch's own clip at the fp32 norm
        want = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
        for w, g in zip(want, grads):
            w.grad = g.clone()
        torch.nn.utils.clip_grads_with_norm_(want, max_norm, norm)
        for p, w in zip(params, want):
            assert torch.equal(p.grad, w.grad)
        return
    # the device grads stay as they were: the host applies the coefficient to its fp32 copy, then fused AdamW
    reference = [torch.nn.Parameter(m.detach().clone()) for _, m in opt._pairs]
    coef = max_norm / (norm.item() + 1e-6)
    for r, (device_p, _) in zip(reference, opt._pairs):
        r.grad = device_p.grad.float() * coef
    opt.step()
    ref_opt = torch.optim.AdamW(reference, lr=1.0, eps=1.0, weight_decay=0.0, betas=tuple(cfg.betas), fused=True)
    ref_opt.step()
    for (_, master), r in zip(opt._pairs, reference):
        assert torch.equal(master, r)


@pytest.mark.parametrize("mode", BF16_MODES)
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_loop_logs_the_fp32_norm_of_bf16_gradients(tmp_path, mode):
    """Through Trainer.train_step: the grad norm in the step's metrics (TensorBoard, metrics.jsonl, the step line)
    is the fp32 norm of the gradients the optimizer is handed (no clipping: they are the raw ones)."""
    trainer = build_trainer(make_job(tmp_path, *DEBUG_FAST, f"precision={mode}", "optim.grad_clip=0"), tmp_path)
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    seen = {}

    def step(closure=None):  # the norm is taken before the step; the step itself (torchao's compiles for a minute
        # on a CPU) is left out
        seen["grads"] = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    trainer.optimizer.step = step
    logged = trainer.train_step()["grad_norm"]
    exact = _exact_norm(seen["grads"])
    assert seen["grads"][0].dtype == torch.bfloat16
    assert abs(torch.nn.utils.get_total_norm(seen["grads"]).item() / exact - 1) > 1e-4  # bf16 would be off
    assert logged == pytest.approx(exact, rel=1e-5)
