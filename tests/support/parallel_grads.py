"""One real training step, under torchrun or alone: rank 0 saves the gradients the optimizer is about to apply
(full tensors) of a first grad_accum=2 step, and the collectives of a later grad_accum=2 and grad_accum=1 step.
Driven by tests/surgery/test_parallel.py.

usage: python tests/support/parallel_grads.py OUT_DIR [train overrides...]
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch


def main(out: Path, overrides: list[str]) -> None:
    """Build the run like training does, take three steps, save {"grads", "collectives"} to OUT/grads.pt."""
    from flexengine.cli.doctor import compose_job
    from flexengine.run import build_trainer

    out.mkdir(parents=True, exist_ok=True)
    record_steps(build_trainer(compose_job([*overrides, f"train.output_dir={out}"]), out), out)


def record_steps(trainer, out: Path, accums: tuple = (2, 2, 1)) -> None:
    """One step per entry of `accums` (its grad_accum); rank 0 saves the first step's gradients and each step's
    collectives and metrics."""
    grads: dict = {}

    def capture(optimizer, args, kwargs) -> None:  # a step pre-hook: after clipping, before the update
        for name, p in trainer.model.named_parameters():
            if p.grad is not None:  # full_tensor() gathers an FSDP2 shard (a collective: every rank calls it)
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = g.detach().float().cpu().clone()

    trainer.optimizer.register_step_pre_hook(capture)
    collectives, first, metrics = {}, {}, []
    # the same number of gradient reductions at grad_accum 2 and 1 is the proof of one sync per window; the
    # first step only warms up (DDP rebuilds its buckets after it) and gives the gradients
    for accum in accums:
        trainer.setup.train.grad_accum = accum
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            metrics.append(trainer.train_step())
        collectives[accum] = [e.name for e in prof.events() if e.name.startswith("c10d::")]
        first = first or dict(grads)  # the first step's: same weights on every run, before any update
    if trainer.dist.is_main:
        torch.save({"grads": first, "collectives": collectives, "metrics": metrics}, out / "grads.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    main(Path(sys.argv[1]), sys.argv[2:])
