"""Soak: a few hundred steps with periodic saves, a signal-forced stop midway, a corrupted newest checkpoint and
a resume; the losses equal an uninterrupted run's, RSS stays flat, no temp directory is left."""

from __future__ import annotations

import os
import signal

import pytest

from flexengine.loop import trainer as trainer_module
from flexengine.run import run_training
from tests.helpers import flip_one_byte, make_job

STEPS, SAVE_EVERY, STOP_AT = 200, 40, 120
# A model small enough for hundreds of steps in seconds on 2 cores (the point is the loop, not the math).
SOAK = [
    f"train.max_steps={STEPS}",
    f"train.save_every={SAVE_EVERY}",
    "train.micro_batch=2",
    "train.grad_accum=1",
    "train.log_every=40",
    "data.seq_len=32",
    "data.demo_max_files=8",
    "model.arch.hidden_size=32",
    "model.arch.intermediate_size=64",
    "model.arch.num_hidden_layers=2",
    "model.arch.num_attention_heads=2",
    "model.arch.num_key_value_heads=1",
    "optim.warmup_steps=10",
]
RSS_GROWTH_LIMIT = 24 * 2**20  # bytes over the second half of the resumed run


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_soak_periodic_saves_forced_stop_corrupt_checkpoint_resume(tmp_path, monkeypatch, caplog):
    straight = run_training(make_job(tmp_path / "straight", *SOAK), tmp_path / "straight")

    real_step = trainer_module.Trainer.train_step
    rss: dict[int, int] = {}  # step -> resident set size after it
    attempt = [1]

    def step(self):
        out = real_step(self)
        if self.state.step + 1 == STOP_AT and attempt[0] == 1:  # preempted during step STOP_AT of the first attempt
            os.kill(os.getpid(), signal.SIGTERM)
        rss[self.state.step + 1] = _rss()
        return out

    monkeypatch.setattr(trainer_module.Trainer, "train_step", step)
    out = tmp_path / "interrupted"
    first = run_training(make_job(out, *SOAK, "train.resume=auto"), out)
    assert first["steps"] == STOP_AT and first["exit_code"] == 128 + signal.SIGTERM
    newest = out / "checkpoints" / f"step_{STOP_AT}"
    flip_one_byte(newest / "model.safetensors")  # finite damage: it would load and silently change the losses

    rss.clear()
    attempt[0] = 2
    second = run_training(make_job(out, *SOAK, "train.resume=auto"), out)
    assert "falling back to" in caplog.text and (out / "checkpoints" / f"step_{STOP_AT}.corrupt").is_dir()
    assert second["steps"] == STEPS and second["exit_code"] == 0
    assert second["losses"] == straight["losses"]  # bit-identical, through the fallback to STOP_AT - SAVE_EVERY

    assert min(rss) == STOP_AT - SAVE_EVERY + 1  # resumed after the fallback step
    warm, end = rss[(STOP_AT - SAVE_EVERY) + (STEPS - STOP_AT + SAVE_EVERY) // 2], rss[STEPS]
    assert end - warm < RSS_GROWTH_LIMIT, f"RSS grew {(end - warm) / 2**20:.1f} MiB over the second half"
    for run in (tmp_path / "straight", out):
        assert not list((run / "checkpoints").glob(".tmp*")), "leftover temp dirs"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(
        [f"step_{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)] + [f"step_{STOP_AT}.corrupt"]
    )
