"""Step callbacks (flexengine/loop/hooks.py) as a Trainer calls them: once before and after each step, with the step
number and its metrics, and each timed phase only for a hook that asks for times."""

from __future__ import annotations

from flexengine.core.config import JobConfig, OptimConfig, TrainConfig
from flexengine.loop.hooks import PHASES, StepHooks
from flexengine.loop.trainer import Trainer
from flexengine.surgery.attention import patch_attention
from tests.helpers import make_llama, random_row_loader, trainer_for

SEQ_LEN = 64


class _Recorder(StepHooks):
    def __init__(self, timed: bool):
        self.timed = timed
        self.calls: list[tuple] = []

    def on_step_start(self, trainer, step):
        self.calls.append(("start", step))

    def on_phase(self, trainer, name, seconds):
        assert seconds >= 0
        self.calls.append(("phase", name))

    def on_step_end(self, trainer, step, metrics):
        self.calls.append(("end", step, sorted(metrics)))


def _trainer(tmp_path, grad_accum: int) -> Trainer:
    job = JobConfig(
        optim=OptimConfig(lr=1e-3, warmup_steps=0),
        train=TrainConfig(micro_batch=1, grad_accum=grad_accum, max_steps=2, progress=False, save_final=False),
    )
    job.data.seq_len = SEQ_LEN
    model = patch_attention(make_llama(0), mode="packed_doc", backend="dense")
    loader = random_row_loader(1, SEQ_LEN, 20)
    return trainer_for(job, model, loader, tmp_path)


def test_every_hook_sees_the_step_and_only_a_timed_one_its_phases(tmp_path):
    trainer = _trainer(tmp_path, grad_accum=2)
    timed, plain = _Recorder(timed=True), _Recorder(timed=False)
    trainer.add_hooks(timed)
    trainer.add_hooks(plain)
    metrics = trainer.train_step()
    assert plain.calls == [("start", 1), ("end", 1, sorted(metrics))]  # no phase times: no device syncs for it
    assert timed.calls[0] == ("start", 1) and timed.calls[-1] == plain.calls[-1]
    phases = [c[1] for c in timed.calls if c[0] == "phase"]
    # the window's data is loaded once, each of its 2 micro-batches builds its mask and runs forward and backward,
    # then the optimizer steps once
    per_micro_batch = ["mask", "forward", "backward"]
    assert phases == ["data", *per_micro_batch, *per_micro_batch, "optimizer"] and set(phases) == set(PHASES)
    assert {"loss", "grad_norm", "tokens", "lr"} <= set(metrics)


def test_the_base_class_observes_nothing_and_is_untimed(tmp_path):
    hooks = StepHooks()
    assert hooks.timed is False
    trainer = _trainer(tmp_path, grad_accum=1)
    trainer.add_hooks(hooks)  # every callback a no-op: a subclass overrides only what it needs
    assert trainer.train_step()["loss"] > 0
