"""The long-horizon step-size check behind `PrecisionSpec.trains_correctly`.

Each precision mode's optimizer, built by flexengine.loop.optim exactly as training builds it, is driven for thousands
of steps on weights shaped like a decoder's (an N(0, 0.02) matrix and a norm weight at 1.0) while the gradient
scale halves, and its mean step over the last steps is compared with fp32 AdamW's on the same gradients.

Why thousands: a state stored in bf16 with round-to-nearest cannot follow a falling gradient scale when one step
moves it by less than half a bf16 ulp (beta2 = 0.999: at most 0.1 % a step against >= 0.2 %). exp_avg_sq then
stays too large and every step too small, a gap that only grows; a proof of a dozen steps cannot see it.

The step is measured on the values the optimizer updates (its param_groups' tensors: the fp32 host masters of
adamw_cpu_offload, the stored weights otherwise). Under stochastic rounding a weight moves by a whole ulp or not
at all, with the expected change equal to the update, so the mean |change| is unbiased there too.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn

from flexengine.core.config import OptimConfig
from flexengine.loop.optim import build_optimizer
from flexengine.surgery.precision import PrecisionSpec, precision_spec

HORIZON_STEPS = 3000  # steps driven
TAIL_STEPS = 500  # the mean step is taken over these last steps
LR = 2e-5  # a 7B fine-tune's lr: its updates are ~1e-3 of a 0.02 weight, under a bf16 ulp
GRAD_SCALE = 1e-3  # gradient scale at step 0 (per element; far above AdamW's eps)
RATIO_BAND = (0.9, 1.1)  # a mode trains correctly when its mean step is within this factor of fp32 AdamW's
BETA2S = (0.95, 0.999)  # short-memory (LLM pretraining) and the HF/TRL default users paste in


class DecoderLikeWeights(nn.Module):
    """A projection matrix N(0, 0.02) of 6,144 elements (24 blocks of 256: torchao quantises it, 8-bit states) and
    a norm weight at 1.0, in `dtype`. The input embedding the 8-bit builder asks for is frozen here."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.proj = nn.Parameter((torch.randn(96, 64, generator=gen) * 0.02).to(dtype))
        self.norm = nn.Parameter(torch.ones(96, dtype=dtype))
        self.embed = nn.Embedding(8, 64, dtype=dtype).requires_grad_(False)

    def get_input_embeddings(self) -> nn.Embedding:
        """The (frozen) input embedding, as HF models expose it."""
        return self.embed


@dataclass(frozen=True)
class Horizon:
    """The run a check drives: its length, the steps averaged at the end, and the gradient scale's fall."""

    steps: int = HORIZON_STEPS
    tail: int = TAIL_STEPS
    halvings: float = 1.0  # the gradient scale at the last step is 2**-halvings of the first's
    seed: int = 0
    # torchao's per-tensor compiled step run eagerly (inductor costs minutes on CPU); the compiled bf16_sr step is
    # checked against the eager one in tests/loop/test_optim_numerics.py::test_compiled_adamw_bf16_step_matches_...
    eager: bool = True


def step_sizes(spec: PrecisionSpec, beta2: float, horizon: Horizon = Horizon()) -> list[float]:
    """Mean |update| of the optimizer's values at each of the last `horizon.tail` steps.

    Gradients: a fixed per-element direction plus as much fresh noise (so exp_avg_sq is mostly noise, as in
    fine-tuning), times a scale falling exponentially; rounded through the compute dtype (autocast's bf16 matmuls
    under bf16_mixed) and stored in the weights' dtype, as backward leaves them."""
    model = DecoderLikeWeights(spec.param_dtype, horizon.seed)
    optim = OptimConfig(name=spec.optimizer, lr=LR, betas=[0.9, beta2], weight_decay=0.0)
    opt = build_optimizer(model, optim, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    values = [v for group in opt.param_groups for v in group["params"]]  # what the optimizer updates
    gen = torch.Generator().manual_seed(horizon.seed + 1)
    direction = [torch.randn(p.shape, generator=gen) for p in params]
    sizes = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of a few thousand elements: a thread pool only adds waits (5x on a busy host)
    try:
        with torch.compiler.set_stance("force_eager" if horizon.eager else "default"):
            for t in range(horizon.steps):
                scale = GRAD_SCALE * 2.0 ** (-horizon.halvings * t / horizon.steps)
                for p, d in zip(params, direction):
                    g = scale * (d + torch.randn(p.shape, generator=gen))
                    p.grad = g.to(spec.compute_dtype).to(p.dtype)
                measured = t >= horizon.steps - horizon.tail
                before = [v.detach().to(torch.float32, copy=True) for v in values] if measured else []
                opt.step()
                opt.zero_grad(set_to_none=True)
                if measured:
                    moved = sum(float((v.detach().float() - b).abs().sum()) for v, b in zip(values, before))
                    sizes.append(moved / sum(v.numel() for v in values))
    finally:
        torch.set_num_threads(threads)
    return sizes


def mean(xs: list[float]) -> float:
    """The arithmetic mean."""
    return sum(xs) / len(xs)


@functools.lru_cache(maxsize=None)
def reference_step(beta2: float, horizon: Horizon = Horizon()) -> float:
    """fp32 AdamW's mean step over the tail (computed once per beta2 and horizon)."""
    return mean(step_sizes(precision_spec("fp32"), beta2, horizon))


def step_ratio(spec: PrecisionSpec, beta2: float, horizon: Horizon = Horizon()) -> float:
    """The mode's mean step over the tail / fp32 AdamW's on the same gradients (1.0 = steps like fp32)."""
    reference = reference_step(beta2, dataclasses.replace(horizon, eager=True))  # torch AdamW: nothing to compile
    return mean(step_sizes(spec, beta2, horizon)) / reference


def within_band(ratio: float) -> bool:
    """Whether a step ratio passes the check."""
    return RATIO_BAND[0] <= ratio <= RATIO_BAND[1]
