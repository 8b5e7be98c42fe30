"""Precision policy: which dtype the weights, gradients and optimizer states are stored in, what the matmuls
compute in, and which optimizer keeps small updates from rounding away. Resolved once into a PrecisionSpec.

bf16 keeps 8 mantissa bits: an AdamW step of lr 2e-5 on a weight of 0.02 is 1e-3 of its value, below half the
bf16 spacing (2^-9 relative), so it rounds back to the old weight; a norm weight of 1.0 needs an update of ~2e-3
to move at all. Modes, most exact first:

  fp32             fp32 weights, grads, states and compute.
  bf16_mixed       fp32 master weights, grads and states; bf16 compute (autocast on one device; FSDP2's
                   MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 sharded params).
  bf16_cpu_master  bf16 weights and grads on the device; fp32 masters and AdamW states in host memory.
  bf16_sr          bf16 weights, grads and exp_avg, fp32 exp_avg_sq; torchao AdamW with stochastic rounding of
                   the weights (unbiased updates; a bf16 exp_avg_sq could not fall: flexengine.loop.adamw_bf16).
  bf16_pure        bf16 everything with torch AdamW: small updates round away. Only when asked.

Under LoRA the frozen base weights are never updated, so an fp32 master of them is pure waste: every bf16 mode
stores frozen matrices (Linear weights, embeddings) in bf16 (`apply_precision`), as PEFT/QLoRA do; the adapters keep
the mode's master dtype. Autocast casts every matmul weight to bf16 anyway, so the matmuls see the same values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from flexengine.core.errors import UserError
from flexengine.core.optimizers import OPTIMIZERS, optimizer_spec
from flexengine.surgery.applied import applied
from flexengine.surgery.family import hf_causal_lm

if TYPE_CHECKING:  # types only: FSDP is imported when a policy is built
    from torch.distributed.fsdp import MixedPrecisionPolicy

log = logging.getLogger(__name__)

PURE_BF16_MIN_LR = 1e-4  # below this, pure-bf16 AdamW leaves most weights unchanged per step (module docstring)


def optimizer_missing(name: str) -> str:
    """The package optim.name needs and this environment lacks ("" when it can be built); imports nothing."""
    package = optimizer_spec(name).package
    return package if package and importlib.util.find_spec(package) is None else ""


def optimizer_state_bytes_per_param(name: str, param_dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(device bytes, host bytes) of optimizer state per trainable parameter for `optim.name` (its OptimizerSpec).

    Weights and gradients themselves are not included, except the fp32 master copy that a host-stepping optimizer
    keeps in host memory. Divide by the world size under FSDP (states are sharded like the parameters).
    """
    spec = optimizer_spec(name)
    return spec.states_in_param_dtype * param_dtype.itemsize + spec.state_bytes, spec.host_bytes


@dataclass(frozen=True)
class PrecisionSpec:
    """A resolved precision mode: what each piece is stored in and what the optimizer must be."""

    name: str
    param_dtype: torch.dtype  # the model's parameters on the device (fp32 = they are the masters)
    compute_dtype: torch.dtype  # matmul dtype: autocast (one device) / FSDP2 param_dtype (sharded)
    optimizer: str  # optim.name this mode needs: adamw | adamw_bf16 (torchao SR) | adamw_cpu_offload
    updates_exact: bool  # updates are applied to fp32 values (never rounded away)
    stochastic_rounding: bool = False  # updates rounded to bf16 without bias (exact in expectation)
    auto_on_cuda: bool = True  # precision=auto weighs it on CUDA (fp32: no; see auto_order)

    @property
    def autocast(self) -> bool:
        """Whether compute runs in a lower dtype than the stored weights (autocast on a single device)."""
        return self.compute_dtype != self.param_dtype

    @property
    def frozen_dtype(self) -> torch.dtype:
        """Dtype of frozen matrices (LoRA's base weights): the bf16 compute dtype when there is one."""
        return torch.bfloat16 if self.compute_dtype == torch.bfloat16 else self.param_dtype

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element."""
        return self.compute_dtype.itemsize

    def bytes_per_param(self) -> dict[str, Optional[float]]:
        """Bytes per trainable parameter: weights, grads, states on the device, and host bytes.

        bf16_mixed on one device also holds autocast's bf16 copy of every weight (cached for the forward and
        saved for backward by the matmuls that use it); frozen matrices (LoRA) are stored in frozen_dtype with no
        copy ("frozen_weights" bytes each). adamw_cpu_offload's host side holds the fp32 master, two fp32
        states and its slot of the transfer buffer (the device dtype: gradients come down and weights go up in it),
        plus one fp32 scratch of the largest parameter when that dtype is not fp32 ("host_scratch" bytes per
        element of the largest trainable tensor; flexengine.loop.host_adamw)."""
        w = self.param_dtype.itemsize
        device, host = optimizer_state_bytes_per_param(self.optimizer, self.param_dtype)
        on_host = optimizer_spec(self.optimizer).steps_on_host
        transfer = w if on_host else 0.0  # the pinned slot each parameter's gradient and weights cross PCIe in
        return {
            "weights": w,
            "grads": w,
            "optimizer": device,
            "compute_copy": 2.0 if self.autocast else 0.0,
            "frozen_weights": self.frozen_dtype.itemsize,
            "host": host + transfer,
            "host_scratch": 4.0 if on_host and w != 4 else 0.0,
            # per input-embedding element, in place of "optimizer" there (None: like every parameter)
            "embedding_optimizer": optimizer_spec(self.optimizer).embedding_state_bytes,
        }

    @property
    def trains_correctly(self) -> bool:
        """Whether this mode's optimizer steps like fp32 AdamW over a long run at any lr (0.9-1.1x its mean step
        after 3,000 steps of a falling gradient scale, beta2 0.95 and 0.999: tests/support/optim_numerics.py, asserted
        for every mode by tests/loop/test_optim_numerics.py). Exact updates do; so does stochastic rounding, now that
        adamw_bf16 keeps exp_avg_sq in fp32. bf16_pure rounds small updates away: never."""
        return self.updates_exact or self.stochastic_rounding

    def updates_arrive(self, lr: float) -> bool:
        """Whether AdamW updates of size ~lr reach bf16-stored weights (always for exact or SR modes)."""
        return self.updates_exact or self.stochastic_rounding or lr >= PURE_BF16_MIN_LR

    def fsdp_policy(self, device: torch.device, enabled: bool = True) -> Optional[MixedPrecisionPolicy]:
        """FSDP2's MixedPrecisionPolicy for this mode's shards, or None (FSDP computes in the stored dtype).

        Only a mode that computes below its stored dtype needs one (bf16_mixed: fp32 shards, params all-gathered in
        compute_dtype, gradients reduce-scattered in fp32), only on CUDA (on CPU/gloo autocast casts, as on one
        device) and only when `enabled` (parallel.mixed_precision)."""
        if not self.fsdp_casts(device.type == "cuda", enabled):
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy  # lazily: a one-process run never loads FSDP

        gather, reduce = self.fsdp_dtypes(on_cuda=True, enabled=enabled)
        return MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=reduce)

    def fsdp_dtypes(self, on_cuda: bool, enabled: bool = True) -> tuple[torch.dtype, torch.dtype]:
        """(dtype FSDP2 all-gathers parameters in, dtype it reduce-scatters gradients in): under this mode's policy
        the compute dtype and fp32 (the masters' dtype), else the stored dtype for both (what the planner counts)."""
        if self.fsdp_casts(on_cuda, enabled):
            return self.compute_dtype, torch.float32
        return self.param_dtype, self.param_dtype

    def fsdp_casts(self, on_cuda: bool, enabled: bool = True) -> bool:
        """Whether FSDP2 casts for this mode (its fsdp_policy is not None), so a sharded forward runs without
        autocast and holds no autocast weight copy: a mode that computes below its stored dtype, on CUDA (on
        CPU/gloo autocast casts, as on one device), when `enabled` (parallel.mixed_precision). apply_fsdp and the
        planner both ask this."""
        return enabled and self.autocast and on_cuda

    def compute_context(self, device: torch.device, fsdp_casts: bool = False) -> contextlib.AbstractContextManager:
        """What forward runs under: autocast to compute_dtype when the weights are stored higher, unless FSDP2
        already gathers them in it (`fsdp_casts`: apply_fsdp applied this mode's fsdp_policy)."""
        if self.autocast and not fsdp_casts:
            return torch.autocast(device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()


# Every precision mode, most exact first: the order precision=auto weighs them in (a tie in estimated step time
# goes to the earlier one; auto_order)
SPECS = {
    "fp32": PrecisionSpec("fp32", torch.float32, torch.float32, "adamw", True, auto_on_cuda=False),
    "bf16_mixed": PrecisionSpec("bf16_mixed", torch.float32, torch.bfloat16, "adamw", True),
    "bf16_cpu_master": PrecisionSpec(
        "bf16_cpu_master", torch.bfloat16, torch.bfloat16, "adamw_cpu_offload", updates_exact=True
    ),
    "bf16_sr": PrecisionSpec(
        "bf16_sr", torch.bfloat16, torch.bfloat16, "adamw_bf16", updates_exact=False, stochastic_rounding=True
    ),
    "bf16_pure": PrecisionSpec("bf16_pure", torch.bfloat16, torch.bfloat16, "adamw", False),
}


def _accepted_optimizers(spec: PrecisionSpec) -> tuple[str, ...]:
    """The mode's own optimizer, then, if that is AdamW, every other that may stand in for it at the mode's weight
    dtype (OptimizerSpec.stands_in_for_adamw)."""
    if spec.optimizer != "adamw":
        return (spec.optimizer,)
    dtype = str(spec.param_dtype).removeprefix("torch.")
    return (spec.optimizer, *(name for name, o in OPTIMIZERS.items() if dtype in o.stands_in_for_adamw))


def auto_order(on_cuda: bool, optimizer: str = "adamw") -> tuple[str, ...]:
    """The modes precision=auto weighs, most exact first; an explicit optim.name narrows them.

    It takes the fastest of those that fit and train correctly (planning/fit.py); bf16_pure never does, and is
    planned only so the plan can show what it would have saved. On CUDA fp32 is left out: the planner's step time
    assumes bf16 tensor cores, and fp32 matmuls run several times slower for updates no more exact than
    bf16_mixed's."""
    return tuple(
        name
        for name, spec in SPECS.items()
        if (spec.auto_on_cuda or not on_cuda) and (optimizer == "adamw" or optimizer in _accepted_optimizers(spec))
    )


def precision_spec(mode: str, optimizer: str = "adamw") -> PrecisionSpec:
    """The spec of a concrete mode, with optim.name checked against it (adamw_8bit keeps its 8-bit states)."""
    if mode not in SPECS:
        raise UserError(f"precision.mode={mode} is not a precision mode; choose auto or one of {', '.join(SPECS)}.")
    spec = SPECS[mode]
    allowed = _accepted_optimizers(spec)
    if optimizer != "adamw" and optimizer not in allowed:
        raise UserError(
            f"precision={mode} needs optim.name={' or '.join(allowed)}, not optim.name={optimizer}; "
            "drop the optim.name override (the precision mode picks the optimizer)."
        )
    # the planner prices the optimizer asked for; a host-stepping one standing in for an fp32-weight mode's AdamW
    # keeps the mode's device bytes (its host side is priced under bf16_cpu_master, whose own optimizer it is)
    if optimizer != "adamw" and not optimizer_spec(optimizer).steps_on_host:
        return dataclasses.replace(spec, optimizer=optimizer)
    return spec


def check_updates_arrive(spec: PrecisionSpec, lr: float) -> None:
    """Warn loudly when pure bf16 would round most updates away at this learning rate."""
    if not spec.updates_arrive(lr):
        log.warning(
            "precision=bf16_pure at optim.lr=%g: AdamW updates of ~lr round away in bf16 storage (most weights "
            "of ~0.02 and every norm weight of 1.0 never move). Use precision=bf16_mixed, bf16_cpu_master or "
            "bf16_sr (stochastic rounding), or precision=auto.",
            lr,
        )


def apply_precision(model: torch.nn.Module, spec: PrecisionSpec) -> int:
    """The precision step of the surgery: record `spec` on model.flexengine (apply_fsdp asks it for the FSDP policy)
    and store frozen matrices in spec.frozen_dtype (LoRA); returns how many elements were cast.

    Only matrices: frozen 1-D parameters (norm weights, biases) stay in the master dtype, since HF's RMSNorm
    returns `weight * x` and an fp32 weight keeps that output, and so the residual stream, in fp32 as before. The
    input embedding's output is cast back to the master dtype for the same reason (a bf16 lookup would make the
    whole residual stream bf16); its values differ from before only by the bf16 rounding autocast gives every
    Linear weight."""
    applied(model).precision = spec
    cast = 0
    for p in model.parameters():
        if not p.requires_grad and p.ndim >= 2 and p.is_floating_point() and p.dtype != spec.frozen_dtype:
            p.data = p.data.to(spec.frozen_dtype)
            cast += p.numel()
    embedding = hf_causal_lm(model).get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if cast and embedding is not None and embedding.weight.dtype != spec.param_dtype:
        # only under autocast: with FSDP2's MixedPrecisionPolicy (no autocast) everything runs in bf16 anyway, and an
        # fp32 copy of the embeddings would be held through the whole forward
        embedding.register_forward_hook(
            lambda module, args, out: out.to(spec.param_dtype) if torch.is_autocast_enabled(out.device.type) else out
        )
    if cast:
        log.info("precision: %.1fM frozen weights stored in %s (no master copy)", cast / 1e6, spec.frozen_dtype)
    return cast
