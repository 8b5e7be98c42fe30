"""`ForwardPath`: what a batch runs through -- the model, the module forward/backward go through (the FSDP/DDP
root, or a plain loss module), the device, the precision and context parallelism -- shared by the trainer's step and
the Evaluator, so that an evaluation computes its loss exactly like training."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from flexengine.core.config import LossConfig
from flexengine.surgery.applied import applied
from flexengine.surgery.attention import mask_kwargs
from flexengine.surgery.context_parallel import ContextParallel
from flexengine.surgery.parallel import LossForward
from flexengine.surgery.precision import PrecisionSpec


@dataclass(frozen=True)
class ForwardPath:
    """The model and how a batch goes through it (see the module docstring); `build` checks the parts agree."""

    model: nn.Module
    train_module: nn.Module  # what forward/backward goes through: the FSDP/DDP root under torchrun, else LossForward
    device: torch.device
    precision: PrecisionSpec
    context_parallel: Optional[ContextParallel] = None  # parallel.cp > 1: each batch is split over the cp ranks

    @classmethod
    def build(
        cls,
        loss: LossConfig,
        model: nn.Module,
        device: torch.device,
        *,
        precision: PrecisionSpec,
        train_module: Optional[nn.Module] = None,
        context_parallel: Optional[ContextParallel] = None,
    ) -> ForwardPath:
        """The path for `model`: a plain loss module unless a parallel root is given, under `precision`, which must
        be the spec the model was prepared for when one was applied (surgery/precision.apply_precision; FSDP's
        policy came from it)."""
        recorded = applied(model).precision
        if recorded is not None and precision != recorded:
            raise ValueError(
                f"ForwardPath(precision={precision.name}) but the model was prepared for precision={recorded.name} "
                "(apply_precision; FSDP shards with its policy): pass the same spec"
            )
        module = train_module if train_module is not None else LossForward(model, loss.chunk_size, loss.fused)
        return cls(model, module, device, precision, context_parallel)

    @property
    def cp(self) -> int:
        """The context-parallel degree (1 without context parallelism)."""
        return self.context_parallel.degree if self.context_parallel is not None else 1

    def prepare(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """(the batch this rank computes, its mask kwargs): the attention mask is built once, here, so every layer
        shares it; under context parallelism the rows are split over the cp ranks."""
        if self.context_parallel is not None:
            return self.context_parallel.shard(self.model, batch)
        return batch, mask_kwargs(self.model, batch["document_ids"])

    def compute_context(self) -> contextlib.AbstractContextManager:
        """What forward runs under: the precision spec decides, told whether FSDP's policy already casts."""
        return self.precision.compute_context(self.device, fsdp_casts=applied(self.model).fsdp_policy is not None)
