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
