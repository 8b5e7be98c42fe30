"""loop/checkpointer.py on a hand-built Trainer (no entry point): a resume continues the run bit for bit and owns
what it restored, the best step is saved once and pointed at, and a resume onto another data stream is refused."""

from __future__ import annotations

import pytest
import torch

from flexengine.core.config import JobConfig, OptimConfig, TrainConfig
from flexengine.core.errors import UserError
from flexengine.loop.checkpointer import check_data_plan
from flexengine.loop.trainer import Trainer
from flexengine.surgery.attention import patch_attention
from tests.helpers import make_llama, random_row_loader, trainer_for

CPU = torch.device("cpu")
SEQ_LEN = 64


def _trainer(out, *, seed: int, max_steps: int = 4, **train) -> Trainer:
    job = JobConfig(
        optim=OptimConfig(lr=1e-2, warmup_steps=1),
        train=TrainConfig(micro_batch=2, grad_accum=2, max_steps=max_steps, progress=False, **train),
    )
    job.data.seq_len = SEQ_LEN
    model = patch_attention(make_llama(seed), mode="packed_doc", backend="dense")
    return trainer_for(job, model, random_row_loader(2, SEQ_LEN), out)


def test_a_resumed_trainer_continues_bit_for_bit_and_owns_what_it_restored(tmp_path):
    torch.manual_seed(0)
    straight = _trainer(tmp_path / "a", seed=0, save_every=2)
    losses = straight.train()["losses"]
    resumed = _trainer(tmp_path / "b", seed=1)  # other initial weights: everything must come from the checkpoint
    counters = resumed.state
    step_2 = tmp_path / "a" / "checkpoints" / "step_2"
    assert resumed.resume(str(step_2)) == step_2
    assert resumed.state is counters and counters.step == 2  # restored in place (the signal handler reads it)
    assert resumed.checkpointer.resumed_from == step_2 and resumed.checkpointer.saved_step == 2
    assert 0 < resumed.progress.train_s <= resumed.progress.wall_s  # the first launch's time, carried on
    summary = resumed.train()
    assert summary["losses"] == losses and summary["steps_run"] == 2  # the same floats: the same steps
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_the_best_step_is_saved_once_and_pointed_at(tmp_path):
    trainer = _trainer(tmp_path, seed=0)
    trainer.state.step = 1
    trainer.checkpointer.keep_best()
    trainer.checkpointer.keep_best()  # the same step again: no second save (a step is never overwritten)
    root = tmp_path / "checkpoints"
    assert (root / "best").resolve() == (root / "step_1").resolve() and trainer.checkpointer.saved_step == 1
    trainer.state.best_step = 1
    assert trainer.checkpointer.best_checkpoint() == root / "step_1"
    quiet = _trainer(tmp_path / "none", seed=0, save_best=False)
    quiet.state.step = 1
    quiet.checkpointer.keep_best()
    assert not (tmp_path / "none" / "checkpoints").exists()
    quiet.state.best_step = 1
    assert quiet.checkpointer.best_checkpoint() is None


def test_a_resume_onto_another_data_stream_is_refused_unless_asked(tmp_path):
    plan = {"seed": 1, "seq_len": 64}
    saved = {"seed": 0, "seq_len": 64}
    with pytest.raises(UserError, match=r"another data stream; changed: seed: 0 -> 1.*train.resume_new_data=true"):
        check_data_plan(plan, saved, tmp_path / "step_2", resume_new_data=False)
    assert check_data_plan(plan, saved, tmp_path / "step_2", resume_new_data=True)  # read the new data from row 0
    assert not check_data_plan(plan, dict(plan), tmp_path / "step_2", resume_new_data=False)
    # data.seq_len=auto chose another length this time: the refusal names the checkpoint's length to pass
    with pytest.raises(UserError, match=r"data.seq_len: 6144 -> 12288.*original settings \(e.g. data.seq_len=6144,"):
        check_data_plan({"data.seq_len": 12288}, {"data.seq_len": 6144}, tmp_path / "step_2", resume_new_data=False)
