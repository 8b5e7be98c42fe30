"""The Trainer on its own: a tiny patched model over a hand-built RowLoader, no entry point, no data pipeline.

The reference for one optimizer step is HF's own loss (`labels=`, `num_items_in_batch=` = the valid targets of
the whole accumulation window) on an independent copy of the model, backward per micro-batch.
"""

from __future__ import annotations

import pytest
import torch

from flexengine.core.config import JobConfig, OptimConfig, TrainConfig
from flexengine.core.errors import UserError
from flexengine.data.loader import RowLoader
from flexengine.loop.trainer import Trainer, rows_counted_once
from flexengine.surgery.attention import patch_attention
from tests.helpers import make_job, make_llama, random_row_loader, trainer_for

SEQ_LEN = 64
CPU = torch.device("cpu")


def _loader(micro_batch: int, n_docs: int = 60) -> RowLoader:
    return random_row_loader(micro_batch, SEQ_LEN, n_docs)


def _trainer(tmp_path, model, *, micro_batch: int = 2, grad_accum: int = 2, **train) -> Trainer:
    job = JobConfig(
        optim=OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.0),
        train=TrainConfig(
            micro_batch=micro_batch, grad_accum=grad_accum, max_steps=3, progress=False, save_final=False, **train
        ),
    )
    job.data.seq_len = SEQ_LEN
    return trainer_for(job, model, _loader(micro_batch), tmp_path)


def _patched(seed: int = 0) -> torch.nn.Module:
    return patch_attention(make_llama(seed), mode="packed_doc", backend="dense")


def _grads_at_step(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The gradients the optimizer sees at its next step (captured by a step pre-hook, before the update)."""
    seen = {}

    def capture(optimizer, args, kwargs):
        seen.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(capture)
    return seen


def test_one_step_matches_hf_loss_over_the_accumulation_window(tmp_path):
    model, reference = _patched(), _patched()  # same seed: same weights, two independent models
    trainer = _trainer(tmp_path, model)
    batches = [trainer.loader.next_batch() for _ in range(2)]
    trainer.loader.load_state_dict({**trainer.loader.state_dict(), "cursor": 0})  # replay the same two batches
    grads = _grads_at_step(trainer)

    m = trainer.train_step()

    n_valid = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    reference.train()
    ref_loss = 0.0
    for b in batches:
        out = reference(
            input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"], num_items_in_batch=n_valid
        )
        out.loss.backward()
        ref_loss += out.loss.item()
    assert m["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert m["tokens"] == sum(b["input_ids"].numel() for b in batches)
    assert m["useful_tokens"] == sum(int(b["useful_tokens"]) for b in batches)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert all(p.grad is None for p in model.parameters())  # zeroed after the step


def test_grad_accumulation_equals_one_bigger_micro_batch(tmp_path):
    # 2 rows at once vs the same 2 rows one by one: the loss divides by the window's valid tokens either way
    one = _trainer(tmp_path / "a", _patched(), micro_batch=2, grad_accum=1)
    two = _trainer(tmp_path / "b", _patched(), micro_batch=1, grad_accum=2)
    grads_one, grads_two = _grads_at_step(one), _grads_at_step(two)
    loss_one, loss_two = one.train_step()["loss"], two.train_step()["loss"]
    assert loss_one == pytest.approx(loss_two, rel=1e-5)
    for name, grad in grads_one.items():
        torch.testing.assert_close(grad, grads_two[name], rtol=1e-4, atol=1e-6, msg=name)


def test_nonfinite_loss_stops_or_is_skipped_and_counted(tmp_path):
    def poisoned() -> torch.nn.Module:
        model = _patched()
        with torch.no_grad():
            model.model.embed_tokens.weight[:] = float("nan")
        return model

    with pytest.raises(UserError, match=r"step 1: loss is nan.*Likely cause: .*optim.grad_clip=0 turns clipping off"):
        _trainer(tmp_path / "a", poisoned()).train_step()
    trainer = _trainer(tmp_path / "b", poisoned(), skip_nonfinite=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    summary = trainer.train()
    assert summary["steps"] == 3 and summary["skipped_nonfinite_steps"] == 3
    assert trainer.scheduler.last_epoch == 0  # a skipped step does not advance the schedule
    for name, p in trainer.model.named_parameters():  # no update went through
        torch.testing.assert_close(p, before[name], equal_nan=True, msg=name)


def test_summary_counts_tokens_and_state_resumes_the_loop(tmp_path):
    trainer = _trainer(tmp_path, _patched())
    summary = trainer.train()
    assert summary["steps"] == 3 and len(summary["losses"]) == 3
    assert summary["tokens_seen"] == 3 * 2 * 2 * SEQ_LEN  # steps x grad_accum x micro_batch x row
    assert 0 < summary["useful_tokens_seen"] < summary["tokens_seen"]
    assert summary["attention"]["mode"] == "packed_doc" and summary["attention"]["backend"] == "dense"
    # trainer_state() is what a checkpoint carries: data position, step counters, optimizer and schedule
    state = trainer.trainer_state()
    assert len(trainer.loader.plan.rows) >= 12  # so the 12 rows read are all of epoch 0
    assert state["train"]["step"] == 3 and state["data"]["epoch"] == 0 and state["data"]["cursor"] == 3 * 2 * 2
    assert state["scheduler"]["last_epoch"] == 3 and len(state["optimizer"]["state"]) > 0


def test_token_counts_count_each_row_once_under_context_parallelism():
    """4 ranks = 2 data-parallel groups x cp 2: both ranks of a cp group read the group's rows and count them.
    The all-reduced sum holds each row cp times; the job's counts are whole numbers, each row once (the per-rank
    share count / cp used to give 255.5-style fractions that were then never summed over the groups)."""
    groups = [torch.tensor([1021.0, 2048.0, 1500.0]), torch.tensor([977.0, 2048.0, 1101.0])]  # valid, tokens, useful
    per_rank = [groups[rank // 2] for rank in range(4)]  # ranks 0, 1: group 0; ranks 2, 3: group 1
    summed = torch.stack(per_rank).double().sum(0)  # what all_reduce(SUM) leaves on every rank
    job = rows_counted_once(summed, cp=2)
    assert job.tolist() == [1998.0, 4096.0, 2601.0] == (groups[0] + groups[1]).tolist()
    assert all(float(x).is_integer() for x in job)
    assert rows_counted_once(summed, cp=1).tolist() == [3996.0, 8192.0, 5202.0]  # cp=1: four dp groups' rows


def test_the_trainers_components_log_under_their_own_names(caplog):
    """checkpointer, evaluator, progress and signals each log as their own module (a log line names its source),
    all under the package's logger, so `logger="flexengine"` filters still see them."""
    import logging

    from flexengine.loop import checkpointer, evaluator, progress, signals

    for module in (checkpointer, evaluator, progress, signals):
        assert module.log.name == module.__name__
    caplog.set_level(logging.INFO, logger="flexengine")
    progress.log.info("probe")
    assert [r.name for r in caplog.records if r.getMessage() == "probe"] == ["flexengine.loop.progress"]


def test_the_trainer_runs_under_the_precision_the_model_was_prepared_for(tmp_path):
    """The spec apply_precision recorded on the model (FSDP's policy came from it) is the step's; a different one
    handed to the Trainer is refused instead of silently computing under another cast."""
    from flexengine.surgery.precision import SPECS, apply_precision

    model = _patched()
    apply_precision(model, SPECS["bf16_mixed"])
    assert _trainer(tmp_path, model).precision == SPECS["bf16_mixed"]  # was: fp32 read from the weights' dtype
    job = JobConfig()
    with pytest.raises(ValueError, match="prepared for precision=bf16_mixed"):
        trainer_for(job, model, _loader(2), tmp_path, precision=SPECS["fp32"])


def test_a_hand_built_trainer_over_several_ranks_refuses_an_unresolved_reduce_every(tmp_path):
    """parallel.reduce_every=auto is the planner's question: a Trainer over several ranks that got it unresolved
    would have to guess when FSDP syncs gradients, so it says who resolves it instead."""
    from flexengine.core.distributed import DistInfo

    job = make_job(tmp_path, "parallel.reduce_every=auto", "train.grad_accum=2")
    with pytest.raises(ValueError, match=r"parallel.reduce_every=auto .*window\|micro_batch"):
        trainer_for(job, make_llama(0), random_row_loader(2, 32, 60), tmp_path, dist=DistInfo(world_size=2))
