"""Optimizers and the learning-rate schedule: plain AdamW, memory-lean AdamW variants, CPU-offloaded states.

`optim.name` picks the optimizer: one `OptimizerSpec` in flexengine.core.optimizers.OPTIMIZERS each, naming its
builder here (what each stores, for the planner, is the spec's too):
  adamw              torch AdamW; two states per parameter in the parameter's dtype
  adamw_8bit         torchao AdamW8bit: block-quantised 8-bit states (~2 bytes/param instead of 8)
  adamw_bf16         torchao AdamW, stochastic rounding of bf16 weights (no fp32 master), bf16 exp_avg and fp32
                     exp_avg_sq (adamw_bf16.py: a bf16 one cannot follow a falling gradient scale)
  adamw_cpu_offload  fp32 master weights and AdamW states in host memory; the step runs on the CPU (host_adamw.py)
"""

from __future__ import annotations

import contextlib
from typing import Iterable, List, Protocol, TypedDict, runtime_checkable

import numpy as np
import torch
from torch import nn

from flexengine.core.config import OptimConfig
from flexengine.core.data_formats import function_named
from flexengine.core.errors import UserError
from flexengine.core.optimizers import OptimizerSpec, optimizer_spec
from flexengine.loop.grad_norm import clip_grad_norm
from flexengine.loop.host_adamw import CPUOffloadAdamW


class AdamArgs(TypedDict):
    """The hyperparameters every builder is handed."""

    lr: float
    betas: tuple[float, float]
    eps: float


@runtime_checkable
class StepsOnHost(Protocol):
    """An optimizer whose update runs on the CPU (OptimizerSpec.steps_on_host; CPUOffloadAdamW): it downloads the
    gradients itself, clips them on the host and holds the fp32 masters the HF export writes."""

    def collecting_grads(self) -> contextlib.AbstractContextManager: ...

    def clip_grad_norm(self, params: list, max_norm: float) -> torch.Tensor: ...

    def master_weights(self, model: nn.Module) -> dict[str, torch.Tensor]: ...


@runtime_checkable
class _WithInputEmbeddings(Protocol):
    """A model that names its input embedding (transformers' models, optim_numerics' stand-in)."""

    def get_input_embeddings(self) -> nn.Module: ...


def _param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    # decay matrices only: norms and biases (ndim < 2) are not regularised
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _import_torchao(name: str, cls: str):
    try:
        import torchao.optim as ao_optim
    except ImportError:
        raise UserError(
            f"optim.name={name} needs torchao, which is not installed. Install it with `pip install torchao` "
            "(a build matching your torch), or use optim.name=adamw / adamw_cpu_offload."
        ) from None
    return getattr(ao_optim, cls)


def last_backward(opt: torch.optim.Optimizer, enabled: bool):
    """Context for the accumulation window's last backward: an optimizer that steps on the host starts each
    download as soon as the gradient is final; others need nothing."""
    return opt.collecting_grads() if enabled and isinstance(opt, StepsOnHost) else contextlib.nullcontext()


def clip_gradients(opt: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The gradients' total norm in fp32 (grad_norm.py), clipped to max_norm (inf: none). An optimizer that steps
    on the host applies the clip there in fp32 inside its step (its downloads may have left before the norm was
    known); others scale the device grads."""
    if isinstance(opt, StepsOnHost):
        return opt.clip_grad_norm(list(params), max_norm)
    return clip_grad_norm(params, max_norm)


def exported_weights(opt: torch.optim.Optimizer, model: nn.Module) -> dict:
    """Tensors the HF export writes in place of the model's own: a host-stepping optimizer's fp32 masters (the
    bf16 device copy rounds away the small updates the masters keep); empty for the other optimizers."""
    return opt.master_weights(model) if isinstance(opt, StepsOnHost) else {}


def _keep_embedding_states_fp32(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    """Give the input embedding full-precision AdamW states (bitsandbytes' StableEmbedding advice).

    Rows of tokens absent from a batch have zero gradients; block-quantised states turn those zeros into
    noise that AdamW normalises into full-size updates (measured on the tiny LLaMA: the embedding moved 33x
    further than under fp32 AdamW in 5 steps). torchao keeps states it finds already initialised.
    """
    if not isinstance(model, _WithInputEmbeddings):
        raise TypeError(
            f"{type(model).__name__} has no get_input_embeddings(): no embedding to keep full-precision states for"
        )
    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor)  # an embedding's weight is a Parameter, never a submodule
    if embedding.requires_grad:  # fp32 whatever the weights' dtype (torchao updates in fp32, then copies in)
        opt.state[embedding] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(embedding, dtype=torch.float32),
            "exp_avg_sq": torch.zeros_like(embedding, dtype=torch.float32),
        }


# The builders OPTIMIZERS names: (param groups, hyperparameters, *, model, optim, device) -> the optimizer.
def build_adamw(groups: List[dict], hyper: AdamArgs, *, optim: OptimConfig, device: torch.device, **_):
    impl = optim.impl if optim.impl != "auto" else ("fused" if device.type == "cuda" else "foreach")
    return torch.optim.AdamW(groups, **hyper, fused=impl == "fused", foreach=impl == "foreach")


def build_adamw_cpu_offload(groups: List[dict], hyper: AdamArgs, **_):
    return CPUOffloadAdamW(groups, **hyper)


def build_adamw_8bit(groups: List[dict], hyper: AdamArgs, *, model: nn.Module, **_):
    opt = _import_torchao("adamw_8bit", "AdamW8bit")(groups, **hyper)
    _keep_embedding_states_fp32(opt, model)
    return opt


def build_adamw_bf16(groups: List[dict], hyper: AdamArgs, **_):
    _import_torchao("adamw_bf16", "_AdamW")  # a clear error when torchao is missing
    from flexengine.loop.adamw_bf16 import AdamWBF16  # subclasses torchao's, imported just above

    return AdamWBF16(groups, **hyper)


def _check_weights(name: str, spec: OptimizerSpec, groups: List[dict]) -> None:
    """Refuse trainable weights of a dtype the optimizer does not take, saying what to do instead."""
    dtypes = {str(p.dtype).removeprefix("torch.") for g in groups for p in g["params"]}
    if spec.param_dtypes and not dtypes <= set(spec.param_dtypes):
        raise UserError(
            f"optim.name={name} takes {' or '.join(spec.param_dtypes)} trainable weights, but the model's are "
            f"{', '.join(sorted(dtypes))}: {spec.other_dtypes_hint or 'change optim.name'}."
        )


def build_optimizer(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by optim.name over the trainable parameters (decay on matrices only)."""
    spec = optimizer_spec(optim.name)
    groups = _param_groups(model, optim.weight_decay)
    # OptimConfig checks that betas holds two numbers
    hyper: AdamArgs = {"lr": optim.lr, "betas": (optim.betas[0], optim.betas[1]), "eps": optim.eps}
    built = function_named(spec.build)(groups, hyper, model=model, optim=optim, device=device)
    _check_weights(optim.name, spec, groups)  # after the builder: a missing package is named first
    return built


def build_scheduler(opt: torch.optim.Optimizer, optim: OptimConfig, max_steps: int):
    """The learning-rate schedule optim.schedule names, from transformers.get_scheduler (a LambdaLR), over
    max_steps updates (see apply_knots for how a resume with another length continues it)."""
    scheduler = _transformers_scheduler(opt, optim, max_steps)
    apply_knots(scheduler, optim, [[0, 0], [max_steps, max_steps]])
    return scheduler


def _transformers_scheduler(opt: torch.optim.Optimizer, optim: OptimConfig, length: int):
    """transformers' LambdaLR for optim.schedule over `length` updates (+1: see apply_knots)."""
    from transformers import get_scheduler

    warmup = min(optim.warmup_for(length), length)
    horizon = length + 1
    kwargs: dict = {}
    name = optim.schedule
    if name == "cosine":  # to lr * min_lr_ratio, not to 0
        name, kwargs = "cosine_with_min_lr", {"min_lr_rate": optim.min_lr_ratio}
    elif name == "warmup_stable_decay":
        decay = max(1, round(optim.decay_fraction * length))
        kwargs = {
            "num_decay_steps": min(decay, horizon - warmup),
            "min_lr_ratio": optim.min_lr_ratio,
            "decay_type": "cosine",
        }
    elif name not in ("linear", "constant", "constant_with_warmup"):
        raise UserError(
            f"optim.schedule={name!r} is not valid; choose one of cosine, linear, constant, "
            "constant_with_warmup, warmup_stable_decay."
        )
    return get_scheduler(
        name, opt, num_warmup_steps=warmup, num_training_steps=horizon, scheduler_specific_kwargs=kwargs or None
    )


def apply_knots(scheduler, optim: OptimConfig, knots: list[list[float]]) -> None:
    """Set the scheduler's factors from the schedule planned over knots[-1][1] updates, read through the piecewise
    linear map `knots` ([updates done, planned update] pairs): identity for a plain run; a resume with another
    train.max_steps adds a knot (resumed_knots). The knots are kept on the scheduler, so its state_dict saves them.

    transformers' schedules give factor 0 at their step 0, so a run's first update would be wasted: update k
    (0-based) here uses the factor of step k + 1 over a horizon of length + 1 steps, so the first update warms up
    at lr / warmup_steps and the last one still moves (linear and decay-to-zero end there).
    """
    opt = scheduler.optimizer
    length = int(knots[-1][1])
    lrs = [group["lr"] for group in opt.param_groups]
    planned = _transformers_scheduler(opt, optim, length)  # its factors only (building it sets the groups' lr)
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    scheduler.lr_lambdas = [_through_knots(f, length + 1, knots) for f in planned.lr_lambdas]
    scheduler.knots = [list(k) for k in knots]
    for group, base_lr, factor in zip(opt.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)  # the lr of the next update
    scheduler._last_lr = [group["lr"] for group in opt.param_groups]


def planned_update(done: float, knots: list[list[float]]) -> float:
    """Where `done` updates stand in the planned schedule: linear between knots, one for one past the last."""
    xs, ys = [k[0] for k in knots], [k[1] for k in knots]
    if done >= xs[-1]:
        return ys[-1] + (done - xs[-1])
    return float(np.interp(done, xs, ys))


def resumed_knots(knots: list[list[float]], done: int, max_steps: int, how: str) -> list[list[float]]:
    """The knots of a run resumed after `done` updates with train.max_steps=max_steps (train.resume_schedule=how):
    unchanged for the same length; rederive: the schedule planned over the new length from update 0 (the lr at
    `done` jumps); continue: the saved run's remaining schedule stretched (or squeezed) over the steps left, so
    the lr goes on from where it was."""
    if max_steps == knots[-1][0] or max_steps <= done:
        return knots
    if how == "rederive":
        return [[0, 0], [max_steps, max_steps]]
    return [k for k in knots if k[0] < done] + [[done, planned_update(done, knots)], [max_steps, knots[-1][1]]]


def _through_knots(factor, horizon: int, knots: list[list[float]]):
    def next_step_factor(step: int) -> float:
        # past the end: the final value (a cosine would rise again)
        return factor(min(planned_update(step + 1, knots), horizon))

    return next_step_factor


def describe_schedule(optim: OptimConfig, max_steps: int) -> str:
    """The schedule in words, its warmup in steps and where that number comes from (for the log)."""
    warmup = min(optim.warmup_for(max_steps), max_steps)
    if optim.warmup_ratio is not None:
        why = f"optim.warmup_ratio={optim.warmup_ratio:g} of train.max_steps={max_steps}"
    else:
        why = "optim.warmup_steps" if optim.warmup_steps is not None else "the default, optim.warmup_steps=null"
    return f"optim.schedule={optim.schedule} over {max_steps} steps at peak lr {optim.lr:g}, warmup {warmup} ({why})"


def describe_resumed_schedule(
    optim: OptimConfig, max_steps: int, knots: list[list[float]], done: int, lr: float
) -> str:
    """describe_schedule for a run resumed after `done` updates onto the schedule planned through `knots`: the
    schedule as planned, where the run resumed and the lr its first resumed step runs at."""
    planned = int(knots[-1][1])
    line = f"{describe_schedule(optim, planned)}; resumed after step {done}: step {done + 1} runs at lr {lr:.3g}"
    if planned == max_steps:
        return line
    if planned_update(done, knots) >= planned:
        return f"{line} (the {planned}-step schedule had finished: its last lr holds to train.max_steps={max_steps})"
    return f"{line} (the rest of the {planned}-step schedule stretched to train.max_steps={max_steps})"


# schedules that decay after warmup (constant and constant_with_warmup stay at the peak)
_DECAYING = ("cosine", "linear", "warmup_stable_decay")


def schedule_problem(optim: OptimConfig, max_steps: int) -> str:
    """Why this schedule cannot do what its name says over max_steps updates ("" if it can): a warmup as long as
    the run never decays (the last update is at the peak lr) or never reaches the peak."""
    warmup = optim.warmup_for(max_steps)
    if optim.schedule == "constant" or warmup < max_steps:
        return ""
    if optim.schedule in _DECAYING:
        what = f"never leaves warmup: its last update is at the peak lr {optim.lr:g}, with no {optim.schedule} decay"
    elif warmup == max_steps:
        return ""  # constant_with_warmup reaching the peak at the last update is what it says
    else:
        what = f"never reaches the peak lr {optim.lr:g} (the last update is at {max_steps / warmup:.0%} of it)"
    source = (
        f"optim.warmup_ratio={optim.warmup_ratio}" if optim.warmup_ratio is not None else f"optim.warmup_steps={warmup}"
    )
    return (
        f"{source} >= train.max_steps={max_steps}: the optim.schedule={optim.schedule} run {what}. Lower "
        "optim.warmup_steps, or set optim.warmup_ratio=0.05 (with optim.warmup_steps=null) to scale it with the run."
    )
