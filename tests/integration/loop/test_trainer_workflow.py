"""The fine-tuning workflow around the loop: held-out eval, best pointer, early stop, retention, samples,
epochs, metrics.jsonl and the plain-text log line."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from flexengine.loop.checkpoint.save import prune_checkpoints
from flexengine.run import build_trainer, run_training
from tests.helpers import DEBUG_FAST, make_job

WORKFLOW = (*DEBUG_FAST, "data.num_workers=0")


def _events(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    return ea


def test_eval_best_retention_samples_and_logs(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="flexengine")
    summary = run_training(
        make_job(
            tmp_path,
            *WORKFLOW,
            "train.max_steps=6",
            "data.eval_fraction=0.1",
            "train.eval_every=2",
            "train.eval_batches=2",
            "train.save_every=1",
            "train.keep_last=2",
            "train.log_every=2",
            "optim.lr=3e-3",
            'train.sample_prompts=["def main("]',
            "train.sample_tokens=3",
        ),
        tmp_path,
    )
    ev = summary["eval"]
    assert [e["step"] for e in ev["history"]] == [2, 4, 6]
    best = min(ev["history"], key=lambda e: e["loss"])
    assert ev["best_step"] == best["step"] and ev["best_loss"] == best["loss"]
    assert ev["ppl"] == pytest.approx(math.exp(ev["loss"]))
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "best").resolve() == (ckpts / f"step_{best['step']}").resolve()
    kept = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))
    assert kept == sorted({"step_5", "step_6", f"step_{best['step']}"})  # newest 2 + the best
    # metrics.jsonl: one record per logged step, one per eval, one per sample
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [2, 4, 6]
    assert [r["step"] for r in records if r["type"] == "eval"] == [2, 4, 6]
    assert [r["step"] for r in records if r["type"] == "sample"] == [2, 4, 6]
    assert {"loss", "lr", "grad_norm", "useful_tokens_per_s", "peak_memory_bytes"} <= set(records[0])
    ea = _events(tmp_path)
    assert [e.step for e in ea.Scalars("eval/loss")] == [2, 4, 6]
    assert ea.Scalars("eval/ppl")[-1].value == pytest.approx(ev["ppl"], rel=1e-5)
    assert "attn/block_density" in ea.Tags()["scalars"] and "attn/block_sparsity" not in ea.Tags()["scalars"]
    assert any(t.startswith("samples/0") for t in ea.Tags()["tensors"])
    # the plain-text line, every log_every steps
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 3 and lines[0].startswith("step 2/6 | loss ")
    for part in ("| lr ", "| grad norm ", "useful tok/s", "| ETA "):
        assert part in lines[0]


def test_eval_loss_equals_hf_loss_per_held_out_document(tmp_path):
    """Packed, masked eval == the token-weighted mean of HF's own loss on each held-out document alone."""
    trainer = build_trainer(
        make_job(tmp_path, *WORKFLOW, "data.eval_fraction=0.1", "data.seq_len=256", "data.long_docs=truncate"), tmp_path
    )
    from transformers import AutoModelForCausalLM

    # an independent model: HF's eager attention, same weights, none of our patching
    ref_model = AutoModelForCausalLM.from_config(copy.deepcopy(trainer.model.config), attn_implementation="eager")
    ref_model.load_state_dict(trainer.model.state_dict())
    ref_model.eval()
    got = trainer.evaluate()
    held = trainer.evaluator.held_out
    total, count = 0.0, 0
    with torch.no_grad():
        for row in held.plan.rows:
            for doc, start, length in row:
                a = held.corpus.offsets[doc] + start
                ids = torch.tensor(held.corpus.tokens[a : a + length], dtype=torch.long)[None]
                out = ref_model(input_ids=ids, labels=ids)
                total += out.loss.item() * (length - 1)
                count += length - 1
    assert got["tokens"] == count
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)


def test_early_stop_keeps_best_and_resumed_from(tmp_path):
    # lr=0: the eval loss never improves after the first evaluation, so patience 1 stops at the second
    summary = run_training(
        make_job(
            tmp_path,
            *WORKFLOW,
            "train.max_steps=8",
            "data.eval_fraction=0.1",
            "train.eval_every=2",
            "train.eval_batches=1",
            "train.early_stop_patience=1",
            "optim.lr=0",
        ),
        tmp_path,
    )
    assert summary["stopped_early"] and summary["steps"] == 4
    assert summary["eval"]["best_step"] == 2 and summary["status"] == "ok"
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "best").resolve().name == "step_2" and (ckpts / "step_4").is_dir()


def test_keep_last_never_deletes_best_or_resumed_from(tmp_path):
    for step in (1, 2, 3, 4, 5):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / "best").symlink_to("step_1")
    deleted = prune_checkpoints(tmp_path, keep_last=2, protect=(tmp_path / "step_2",))
    assert sorted(p.name for p in deleted) == ["step_3"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_1",
        "step_2",
        "step_4",
        "step_5",
    ]
    assert prune_checkpoints(tmp_path, keep_last=0) == []  # 0 keeps everything


def test_epochs_set_max_steps_from_the_packed_plan(tmp_path):
    trainer = build_trainer(make_job(tmp_path, *WORKFLOW, "train.epochs=0.5", "train.grad_accum=2"), tmp_path)
    per_epoch = trainer.loader.batches_per_epoch
    assert trainer.setup.train.max_steps == math.ceil(0.5 * per_epoch / 2)


def test_resume_truncates_metrics_of_the_lost_steps(tmp_path):
    run_training(make_job(tmp_path, *WORKFLOW, "train.max_steps=3", "train.save_every=2"), tmp_path)
    (tmp_path / "checkpoints" / "step_3").rename(tmp_path / "gone")  # as if killed after step 3's log line
    run_training(make_job(tmp_path, *WORKFLOW, "train.max_steps=3", "train.resume=auto"), tmp_path)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_early_stop_needs_a_held_out_set(tmp_path):
    from flexengine.core.errors import UserError

    with pytest.raises(UserError, match="data.eval_fraction"):
        make_job(tmp_path, *WORKFLOW, "train.early_stop_patience=2")


def test_schedule_that_cannot_decay_or_changes_on_resume_is_reported(tmp_path, caplog):
    """A run no longer than its warmup ends at the peak lr, and a resume with another train.max_steps says what the
    lr does: a finished schedule keeps its last lr (continue), or is planned again over the new length (rederive)."""
    caplog.set_level(logging.WARNING, logger="flexengine")
    build_trainer(make_job(tmp_path / "a", *WORKFLOW, "train.max_steps=4", "optim.warmup_steps=10"), tmp_path / "a")
    assert "optim.warmup_steps=10 >= train.max_steps=4" in caplog.text and "peak lr" in caplog.text
    caplog.clear()
    run_training(make_job(tmp_path, *WORKFLOW, "train.max_steps=3", "optim.warmup_steps=1"), tmp_path)
    same = build_trainer(make_job(tmp_path, *WORKFLOW, "train.max_steps=3", "optim.warmup_steps=1"), tmp_path)
    same.resume("auto")
    assert "re-derived" not in caplog.text
    last_lr = _logged_lrs(tmp_path)[-1]  # the lr step 3 trained with
    longer = build_trainer(make_job(tmp_path, *WORKFLOW, "train.max_steps=30", "optim.warmup_steps=1"), tmp_path)
    longer.resume("auto")
    assert "train.max_steps 3 -> 30: the saved run had finished its schedule" in caplog.text
    assert float(longer.optimizer.param_groups[0]["lr"]) == pytest.approx(last_lr)
    again = ("train.max_steps=30", "optim.warmup_steps=1", "train.resume_schedule=rederive")
    rederived = build_trainer(make_job(tmp_path, *WORKFLOW, *again), tmp_path)
    rederived.resume("auto")
    assert "train.resume_schedule=rederive: the schedule is planned over 30 steps" in caplog.text
    assert float(rederived.optimizer.param_groups[0]["lr"]) > 2 * last_lr  # the 30-step cosine at step 4


def _logged_lrs(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in rows if r["type"] == "train"]


# -- a stop signal during evaluation or sampling ---------------------------------------------------------------------


def _signal_on(counter: list, at: int) -> None:
    import os
    import signal

    counter.append(1)
    if len(counter) == at:
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("eval_every", [2, 0])  # in the loop, and the final evaluation at the end of the run
def test_a_signal_during_evaluation_stops_it_at_the_next_batch_and_saves(tmp_path, eval_every):
    """Before: the whole held-out set was evaluated first (452 s without an answer to the signal, measured)."""
    trainer = build_trainer(
        make_job(tmp_path, *WORKFLOW, "train.max_steps=2", "data.eval_fraction=0.5", f"train.eval_every={eval_every}"),
        tmp_path,
    )
    total = sum(1 for _ in trainer.evaluator.held_out.batches())
    assert total >= 4, total
    fetched, batches = [], trainer.evaluator.held_out.batches

    def batches_then_signal():
        for batch in batches():
            _signal_on(fetched, 1)
            yield batch

    trainer.evaluator.held_out.batches = batches_then_signal
    summary = trainer.train()
    assert len(fetched) <= 2 < total  # the batch in hand, and at most the one fetched before the check
    assert summary["steps"] == 2 and summary["exit_code"] == 143 and summary["status"] == "interrupted"
    assert summary["eval"] is None  # a partial held-out set is not an eval loss
    assert (tmp_path / "checkpoints" / "step_2" / "manifest.json").is_file()


def test_a_signal_during_sampling_stops_it_at_the_next_token_and_saves(tmp_path):
    """Before: every prompt ran to sample_tokens (287 s unanswered, and no checkpoint existed yet)."""
    trainer = build_trainer(
        make_job(
            tmp_path,
            *WORKFLOW,
            "train.max_steps=3",
            "train.sample_every=1",
            "train.sample_tokens=40",
            'train.sample_prompts=["def main(", "import os"]',
            "train.save_final=false",
        ),
        tmp_path,
    )
    forward, sampled = trainer.train_module, []

    def counting_forward(batch, **kwargs):
        if kwargs.get("logits"):
            _signal_on(sampled, 2)
        return forward(batch, **kwargs)

    # the Evaluator samples through its own forward path (loop/forward.py), handed to it at construction
    trainer.evaluator.forward = dataclasses.replace(trainer.evaluator.forward, train_module=counting_forward)
    summary = trainer.train()
    assert len(sampled) == 2  # stopped before the third token (80 forwards before)
    assert summary["steps"] == 1 and summary["exit_code"] == 143
    assert (tmp_path / "checkpoints" / "step_1" / "manifest.json").is_file()


def test_evaluation_is_logged_timed_and_counted_in_eta_and_wall_time(tmp_path, caplog, monkeypatch):
    """Each evaluation says it started; wall_s is the whole run (evaluations included), train_s the training
    alone (what tokens/s divides by); the ETA counts the evaluations still due; a dear first evaluation is
    told what train.eval_batches to set."""

    import flexengine.loop.evaluator as ev

    monkeypatch.setattr(ev, "EVAL_BUDGET", 0.0)  # any evaluation is "too dear": the advice must appear
    caplog.set_level(logging.INFO, logger="flexengine")
    job = make_job(tmp_path, *WORKFLOW, "train.max_steps=4", "data.eval_fraction=0.2", "train.eval_every=2")
    summary = run_training(job, tmp_path)
    text = caplog.text
    assert "eval step 2: " in text and "batches" in text
    assert "eval: one evaluation (the whole held-out set" in text and "set train.eval_batches=" in text
    assert text.count("eval: one evaluation") == 1  # judged once, on the first in-loop evaluation
    assert summary["eval_s"] > 0 and summary["train_s"] > 0
    assert summary["wall_s"] >= summary["train_s"] + summary["eval_s"]
    assert summary["useful_tokens_per_s"] == pytest.approx(summary["useful_tokens_seen"] / summary["train_s"])
    # the ETA of a fresh 6-step run: 3 evaluations due (steps 2, 4, 6) at the measured cost of one
    trainer = build_trainer(
        make_job(tmp_path / "b", *WORKFLOW, "train.max_steps=6", "data.eval_fraction=0.2", "train.eval_every=2"),
        tmp_path / "b",
    )
    trainer.progress.start_loop(0)
    trainer.evaluator.eval_seconds = [50.0]
    assert trainer.eta_s() >= 3 * 50.0
    trainer.state.step = 6  # the last step's line comes before its evaluation: that one is still due
    assert trainer.eta_s() >= 50.0


def test_the_resume_messages_quote_the_lrs_the_loop_logs(tmp_path, caplog):
    """Resuming step 3 of a 6-step run with train.max_steps=12: the warning quoted the saved schedule's lr for step 4
    (0.00045) as where the lr 'goes on from', while step 4 ran at another one and step 3 had run at a third. It now
    names the last trained step's lr and the first resumed step's, each as metrics.jsonl logs it, and the schedule
    line says the run resumed (it described a fresh 12-step cosine)."""
    caplog.set_level(logging.INFO, logger="flexengine")
    first = (*WORKFLOW, "optim.warmup_steps=1", "train.max_steps=6", "train.save_every=3")
    run_training(make_job(tmp_path / "a", *first), tmp_path / "a")
    step_3 = _logged_lrs(tmp_path / "a")[2]
    messages = [r.getMessage() for r in caplog.records]
    assert "resumed" not in next(m for m in messages if m.startswith("optim: optim.schedule"))
    resume = f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_3'}"
    for how, lr_at in (("continue", ("lr ", "")), ("rederive", ("", "lr "))):
        caplog.clear()
        again = (*WORKFLOW, "optim.warmup_steps=1", "train.max_steps=12", resume, f"train.resume_schedule={how}")
        run_training(make_job(tmp_path / how, *again), tmp_path / how)
        step_4 = _logged_lrs(tmp_path / how)[0]
        assert not math.isclose(step_4, step_3)
        messages = [r.getMessage() for r in caplog.records]
        warning = next(m for m in messages if m.startswith("resume: train.max_steps"))
        assert f"step 3, the last trained, ran at {lr_at[0]}{step_3:.3g}" in warning
        assert f"step 4, the first resumed, runs at {lr_at[1]}{step_4:.3g}" in warning
        schedule = next(m for m in messages if m.startswith("optim: optim.schedule"))
        assert f"; resumed after step 3: step 4 runs at lr {step_4:.3g}" in schedule
        planned = 6 if how == "continue" else 12  # continue: the saved 6-step schedule, its rest stretched
        assert schedule.startswith(f"optim: optim.schedule=cosine over {planned} steps")
        stretched = "(the rest of the 6-step schedule stretched to train.max_steps=12)"
        assert (stretched in schedule) == (how == "continue")
