"""The trainer's context-parallel step on CPU (gloo), under torchrun: build the run like flexengine.run does, with
parallel.cp and FlexAttention, but with flex's kernel replaced by SDPA on the CP BlockMask's own mask
(`tests.helpers.sdpa_on_block_mask`: flex has no CPU backward, so build_trainer refuses flex on CPU). Everything
else is the real path: the loader's rows per data-parallel group, torch's K/V all-gather and its reduce-scatter
backward, PTRR load balancing, shifted targets, FSDP2 over dp x cp, the trainer's global normalisation over an
accumulation window. Saves the first step's gradients like tests/support/parallel_grads.py (one step only).

usage: torchrun --nproc_per_node {2,4} tests/support/context_parallel_trainer.py OUT_DIR [train overrides...]
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch


def main(out: Path, overrides: list[str]) -> None:
    """The steps of tests/support/parallel_grads.py on a context-parallel trainer."""
    import torch.distributed.tensor.experimental._context_parallel._attention as cp_attention
    from torch.nn.attention.flex_attention import create_block_mask

    from flexengine.cli.doctor import compose_job
    from flexengine.core.distributed import init_distributed
    from flexengine.core.parallel_spec import resolve_parallel
    from flexengine.surgery.attention import apply_attention, resolve_attention_spec
    from flexengine.surgery.attention.patch import CP_ATTENTION
    from flexengine.surgery.context_parallel import build_context_parallel
    from flexengine.surgery.memory import decoder_layers
    from flexengine.surgery.model import load_model, load_tokenizer
    from flexengine.surgery.parallel import apply_parallel
    from tests.helpers import job_data, sdpa_on_block_mask, trainer_for
    from tests.support.parallel_grads import record_steps

    # torch's CP mask builder, uncompiled: compiling it costs each of up to 4 processes on 2 cores ~10 s, and
    # the compiled builder is an optimisation of this same function (tests/support/context_parallel_forward.py runs it)
    cp_attention._compiled_create_block_mask = create_block_mask
    out.mkdir(parents=True, exist_ok=True)
    # a Trainer built by hand states its gradient sync (run.py takes the planner's choice): once per window
    job = compose_job([*overrides, "parallel.reduce_every=window", f"train.output_dir={out}"])
    device = torch.device("cpu")
    torch.manual_seed(job.train.seed)
    info = init_distributed(job.parallel, device)
    cp = build_context_parallel(info, device)
    tokenizer = load_tokenizer(job.model)
    loader, _, _ = job_data(job, tokenizer, info, flex=True)
    model = load_model(job.model, device)
    apply_attention(model, resolve_attention_spec(job.attn, model.config, device=device))
    cp.apply(model)
    for layer in decoder_layers(model):
        getattr(layer.self_attn, CP_ATTENTION).flex = sdpa_on_block_mask
    root = apply_parallel(model, resolve_parallel(job.parallel), info, device, job.loss, fsdp_mesh=cp.fsdp_mesh)
    trainer = trainer_for(
        job, model, loader, out, tokenizer=tokenizer, dist=info, device=device, train_module=root, context_parallel=cp
    )
    record_steps(trainer, out, accums=(2,))  # the first step's gradients: one accumulation window of 2


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    main(Path(sys.argv[1]), sys.argv[2:])
