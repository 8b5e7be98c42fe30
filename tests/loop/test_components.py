"""loop/components.py: one run's components share one TrainState and one forward path, and a Trainer handed them
runs with exactly those (run.py's way), while a hand-built Trainer gets the same set without a held-out set."""

from __future__ import annotations

import pytest
import torch

from flexengine.core.config import JobConfig, TrainConfig
from flexengine.core.distributed import DistInfo
from flexengine.loop.components import build_components
from flexengine.loop.forward import ForwardPath
from flexengine.loop.trainer import Trainer
from flexengine.surgery.attention import patch_attention
from tests.helpers import make_llama, random_row_loader

CPU = torch.device("cpu")
SEQ_LEN = 64


def _job() -> JobConfig:
    job = JobConfig(train=TrainConfig(micro_batch=2, grad_accum=1, max_steps=2, progress=False, save_final=False))
    job.data.seq_len = SEQ_LEN
    return job


def test_the_components_share_one_state_and_one_forward_path(tmp_path):
    job, model = _job(), patch_attention(make_llama(), mode="packed_doc", backend="dense")
    forward = ForwardPath.build(job, model, CPU)
    c = build_components(job, forward, random_row_loader(2, SEQ_LEN), None, out_dir=tmp_path, dist=DistInfo())
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
    c = build_components(job, ForwardPath.build(job, model, CPU), loader, None, out_dir=tmp_path, dist=DistInfo())
    trainer = Trainer(job, model, None, loader, out_dir=tmp_path, device=CPU, components=c)
    assert (trainer.state, trainer.optimizer, trainer.checkpointer, trainer.evaluator) == (
        c.state,
        c.optimizer,
        c.checkpointer,
        c.evaluator,
    )
    summary = trainer.train()
    assert c.state.step == 2 and summary["steps"] == 2 and len(summary["losses"]) == 2
    with pytest.raises(ValueError, match="components' model"):
        Trainer(job, make_llama(), None, loader, out_dir=tmp_path, device=CPU, components=c)


def test_a_trainer_refuses_components_built_around_another_loader_job_or_directory(tmp_path):
    """Components built around loader A and a 2-step job, handed to a Trainer of loader B or a 3-step job, would
    train B (or 3 steps) while their checkpoints record A's position and 2 steps: refused, naming what differs."""
    import dataclasses

    job, model = _job(), patch_attention(make_llama(), mode="packed_doc", backend="dense")
    loader = random_row_loader(2, SEQ_LEN)
    c = build_components(job, ForwardPath.build(job, model, CPU), loader, None, out_dir=tmp_path, dist=DistInfo())
    with pytest.raises(ValueError, match="got another loader than"):
        Trainer(job, model, None, random_row_loader(2, SEQ_LEN), out_dir=tmp_path, device=CPU, components=c)
    longer = dataclasses.replace(job, train=dataclasses.replace(job.train, max_steps=3))
    with pytest.raises(ValueError, match="got another job than"):
        Trainer(longer, model, None, loader, out_dir=tmp_path, device=CPU, components=c)
    with pytest.raises(ValueError, match="got another out_dir than"):
        Trainer(job, model, None, loader, out_dir=tmp_path / "other", device=CPU, components=c)
    with pytest.raises(ValueError, match="got another tokenizer than"):
        Trainer(job, model, object(), loader, out_dir=tmp_path, device=CPU, components=c)
    with pytest.raises(ValueError, match="got another dist than"):
        Trainer(
            job, model, None, loader, out_dir=tmp_path, device=CPU, dist=DistInfo(rank=1, world_size=2), components=c
        )
    trainer = Trainer(job, model, None, loader, out_dir=tmp_path / ".", device=CPU, components=c)  # same directory
    assert trainer.checkpointer is c.checkpointer


def test_sample_prompts_without_a_tokenizer_are_refused_when_the_components_are_built(tmp_path):
    """Sampling needs the tokenizer: refused at build time, not at the run's end (before its final save)."""
    import dataclasses

    from flexengine.core.errors import UserError

    job, model = _job(), patch_attention(make_llama(), mode="packed_doc", backend="dense")
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, sample_prompts=["Once"]))
    with pytest.raises(UserError, match="train.sample_prompts: sampling needs the run's tokenizer"):
        build_components(
            job,
            ForwardPath.build(job, model, CPU),
            random_row_loader(2, SEQ_LEN),
            None,
            out_dir=tmp_path,
            dist=DistInfo(),
        )


def test_the_clock_leaves_out_compile_steps_when_a_memory_policy_compiled_the_blocks(tmp_path):
    """Blocks compiled by a policy that needs them compiled (train.compile=false) compile in their first steps
    too: the run clock keys its warm-up on the model's compiled blocks, not on train.compile."""
    from flexengine.surgery.applied import applied

    job, model = _job(), patch_attention(make_llama(), mode="packed_doc", backend="dense")
    forward = ForwardPath.build(job, model, CPU)
    eager = build_components(job, forward, random_row_loader(2, SEQ_LEN), None, out_dir=tmp_path, dist=DistInfo())
    assert not job.train.compile and not eager.progress.compiled_blocks
    applied(model).compile_backend = "inductor"  # what surgery/compile.apply_compile records
    compiled = build_components(job, forward, random_row_loader(2, SEQ_LEN), None, out_dir=tmp_path, dist=DistInfo())
    assert compiled.progress.compiled_blocks
