"""loop/components.py: one run's components share one TrainState and one forward path, and the Trainer built from
them (Trainer(setup, components), the one way) runs with exactly those."""

from __future__ import annotations

import torch

from flexengine.core.config import JobConfig, TrainConfig
from flexengine.loop.trainer import Trainer
from flexengine.surgery.attention import patch_attention
from tests.helpers import job_components, job_forward, make_llama, random_row_loader

CPU = torch.device("cpu")
SEQ_LEN = 64


def _job() -> JobConfig:
    job = JobConfig(train=TrainConfig(micro_batch=2, grad_accum=1, max_steps=2, progress=False, save_final=False))
    job.data.seq_len = SEQ_LEN
    return job


def test_the_components_share_one_state_and_one_forward_path(tmp_path):
    job, model = _job(), patch_attention(make_llama(), mode="packed_doc", backend="dense")
    forward = job_forward(job, model)
    _, c = job_components(job, forward, random_row_loader(2, SEQ_LEN), tmp_path)
    assert c.progress.state is c.state and c.checkpointer.state is c.state and c.evaluator.state is c.state
    assert c.evaluator.forward is forward and c.checkpointer.forward is forward
    assert c.evaluator.checkpointer is c.checkpointer and c.evaluator.progress is c.progress
    assert c.checkpointer.optimizer is c.optimizer and c.scheduler.optimizer is c.optimizer
    assert c.evaluator.held_out is None and c.checkpointer.data_plan == {}
    c.state.step = 7
    assert c.signals.step() == 7  # the stop signals name the shared state's step


def test_a_trainer_runs_with_the_components_it_is_handed(tmp_path):
    job, model = _job(), patch_attention(make_llama(), mode="packed_doc", backend="dense")
    loader = random_row_loader(2, SEQ_LEN)
    setup, c = job_components(job, job_forward(job, model), loader, tmp_path)
    trainer = Trainer(setup, c)
    assert (trainer.model, trainer.loader, trainer.out_dir) == (model, loader, tmp_path)
    assert (trainer.state, trainer.optimizer, trainer.checkpointer, trainer.evaluator) == (
        c.state,
        c.optimizer,
        c.checkpointer,
        c.evaluator,
    )
    summary = trainer.train()
    assert c.state.step == 2 and summary["steps"] == 2 and len(summary["losses"]) == 2


def test_sample_prompts_without_a_tokenizer_are_refused_when_the_components_are_built(tmp_path):
    """Sampling needs the tokenizer: refused at build time, not at the run's end (before its final save)."""
    import dataclasses

    import pytest

    from flexengine.core.errors import UserError

    job, model = _job(), patch_attention(make_llama(), mode="packed_doc", backend="dense")
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, sample_prompts=["Once"]))
    with pytest.raises(UserError, match="train.sample_prompts: sampling needs the run's tokenizer"):
        job_components(job, job_forward(job, model), random_row_loader(2, SEQ_LEN), tmp_path)


def test_the_clock_leaves_out_compile_steps_when_a_memory_policy_compiled_the_blocks(tmp_path):
    """Blocks compiled by a policy that needs them compiled (train.compile=false) compile in their first steps
    too: the run clock keys its warm-up on the model's compiled blocks, not on train.compile."""
    from flexengine.surgery.applied import applied

    job, model = _job(), patch_attention(make_llama(), mode="packed_doc", backend="dense")
    forward = job_forward(job, model)
    _, eager = job_components(job, forward, random_row_loader(2, SEQ_LEN), tmp_path)
    assert not job.train.compile and not eager.progress.compiled_blocks
    applied(model).compile_backend = "inductor"  # what surgery/compile.apply_compile records
    _, compiled = job_components(job, forward, random_row_loader(2, SEQ_LEN), tmp_path)
    assert compiled.progress.compiled_blocks
