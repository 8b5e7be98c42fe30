"""Optimizer choices: plain AdamW, CPU-offloaded AdamW (== AdamW), torchao 8-bit/bf16 (or a clear error)."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from flexengine.core.config import OptimConfig
from flexengine.core.errors import UserError
from flexengine.loop.optim import CPUOffloadAdamW, build_optimizer, build_scheduler, describe_resumed_schedule
from flexengine.surgery.precision import optimizer_state_bytes_per_param
from tests.helpers import clone_model

CPU = torch.device("cpu")


def _steps(model, opt, n: int, seed: int = 0) -> list:
    """n optimizer steps on random token batches; returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _state_bytes(opt) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.ndim > 0
    )


def test_adamw_decays_matrices_only_and_matches_torch(tiny_llama):
    twin = clone_model(tiny_llama).train()
    tiny_llama.train()
    opt = build_optimizer(tiny_llama, OptimConfig(name="adamw", weight_decay=0.1), CPU)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(p.ndim >= 2 for p in opt.param_groups[0]["params"])
    assert all(p.ndim < 2 for p in opt.param_groups[1]["params"])
    # independent reference: torch AdamW with the same two groups
    matrices = [p for p in twin.parameters() if p.ndim >= 2]
    vectors = [p for p in twin.parameters() if p.ndim < 2]
    ref = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    assert _steps(tiny_llama, opt, 3) == pytest.approx(_steps(twin, ref, 3), rel=1e-6)
    measured = _state_bytes(opt) / sum(p.numel() for p in tiny_llama.parameters())
    assert measured == optimizer_state_bytes_per_param("adamw", torch.float32)[0] == 8.0


def test_cpu_offload_adamw_equals_adamw_and_resumes(tiny_llama):
    models = [clone_model(tiny_llama).train() for _ in range(3)]
    cfg = OptimConfig(name="adamw_cpu_offload")
    plain = build_optimizer(models[0], OptimConfig(name="adamw"), CPU)
    offload = build_optimizer(models[1], cfg, CPU)
    assert isinstance(offload, CPUOffloadAdamW)
    want = _steps(models[0], plain, 4)
    assert _steps(models[1], offload, 4) == pytest.approx(want, rel=1e-6)
    for a, b in zip(models[0].parameters(), models[1].parameters()):  # fused (host) vs foreach: <= 2 fp32 ulps
        torch.testing.assert_close(a, b, atol=1e-7, rtol=2.4e-7)
    # the offloaded states are the host masters' (fp32 master + 2 states per parameter on the host)
    n = sum(p.numel() for p in tiny_llama.parameters())
    host = _state_bytes(offload) + sum(h.numel() * h.element_size() for _, h in offload._pairs)
    assert host / n == optimizer_state_bytes_per_param("adamw_cpu_offload")[1] == 12.0

    # resume: weights copied in, then the state loaded, continues like the uninterrupted run
    resumed_model = models[2]
    part = build_optimizer(resumed_model, cfg, CPU)
    _steps(resumed_model, part, 2)
    saved_weights, saved_state = resumed_model.state_dict(), part.state_dict()
    fresh = clone_model(tiny_llama).train()
    fresh.load_state_dict(saved_weights)
    cont = build_optimizer(fresh, cfg, CPU)
    cont.load_state_dict(saved_state)
    reference = clone_model(tiny_llama).train()
    ref_opt = build_optimizer(reference, cfg, CPU)
    _steps(reference, ref_opt, 2)
    assert _steps(fresh, cont, 2, seed=1) == pytest.approx(_steps(reference, ref_opt, 2, seed=1), rel=1e-6)


def test_torchao_choices_fail_clearly_without_torchao(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import torchao.optim -> ImportError
    for name in ("adamw_8bit", "adamw_bf16"):
        with pytest.raises(UserError, match=f"optim.name={name} needs torchao.*pip install torchao"):
            build_optimizer(tiny_llama, OptimConfig(name=name), CPU)


def test_adamw_8bit_tracks_fp32_adamw_with_quarter_state(tiny_llama):
    start = [p.detach().clone() for p in tiny_llama.parameters()]
    twin = clone_model(tiny_llama).train()
    tiny_llama.train()
    want = _steps(twin, build_optimizer(twin, OptimConfig(name="adamw"), CPU), 5)
    opt = build_optimizer(tiny_llama, OptimConfig(name="adamw_8bit"), CPU)
    got = _steps(tiny_llama, opt, 5)
    assert got == pytest.approx(want, rel=2e-2)  # 8-bit states: close, not equal
    # the 8-bit update points where fp32 AdamW's does
    delta_8bit = torch.cat([(p.detach() - s).flatten() for p, s in zip(tiny_llama.parameters(), start)])
    delta_fp32 = torch.cat([(p.detach() - s).flatten() for p, s in zip(twin.parameters(), start)])
    assert torch.nn.functional.cosine_similarity(delta_8bit, delta_fp32, dim=0) > 0.95


def test_adamw_bf16_needs_bf16_weights(tiny_llama):
    with pytest.raises(UserError, match="precision=bf16_sr"):
        build_optimizer(tiny_llama, OptimConfig(name="adamw_bf16"), CPU)
    model = tiny_llama.to(torch.bfloat16).train()
    opt = build_optimizer(model, OptimConfig(name="adamw_bf16", lr=1e-2), CPU)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    losses = []
    for _ in range(4):  # one batch, over and over: the loss must fall
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())


@pytest.mark.slow  # torchao compiles its bf16 step (minutes on a shared 2-core machine)
def test_adamw_8bit_embedding_states_are_fp32_with_bf16_weights(tiny_llama):
    """The docstring's promise: full-precision states for the embedding even when the weights are bf16."""
    model = tiny_llama.to(torch.bfloat16).train()
    opt = build_optimizer(model, OptimConfig(name="adamw_8bit"), CPU)
    embedding = model.get_input_embeddings().weight
    assert opt.state[embedding]["exp_avg"].dtype == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    state = opt.state[embedding]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert state["exp_avg"].abs().sum() > 0  # the step wrote into them (not replaced by torchao's own)
    assert embedding.dtype == torch.bfloat16


def test_state_bytes_table_and_bad_name():
    assert optimizer_state_bytes_per_param("adamw", torch.bfloat16) == (4.0, 0.0)
    device_8bit, _ = optimizer_state_bytes_per_param("adamw_8bit")
    assert 2.0 < device_8bit < 2.1
    with pytest.raises(UserError, match="optim.name"):
        OptimConfig(name="sgd")
    with pytest.raises(UserError, match="optim.name"):
        optimizer_state_bytes_per_param("sgd")


def test_scheduler_warms_up_then_decays_to_min_ratio():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1), max_steps=10)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1) and all(a >= b for a, b in itertools.pairwise(lrs[1:]))


def test_cpu_offload_adamw_resume_restores_exact_fp32_masters():
    """bf16 device weights round the masters; the optimizer state must carry them for an exact resume."""
    from torch import nn

    from flexengine.loop.optim import CPUOffloadAdamW

    torch.manual_seed(0)
    layer = nn.Linear(64, 64).to(torch.bfloat16)
    opt = CPUOffloadAdamW([{"params": list(layer.parameters())}], lr=1e-3)
    for _ in range(3):
        layer(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    restored = CPUOffloadAdamW([{"params": list(layer.parameters())}], lr=1e-3)
    restored.load_state_dict(opt.state_dict())
    for (_, want), (_, got) in zip(opt._pairs, restored._pairs):
        assert torch.equal(want, got)
    assert any(not torch.equal(m, p.float()) for (p, m) in opt._pairs)  # bf16 weights alone would not do


def _lrs(schedule: str = "cosine", max_steps: int = 20, **kw) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1.0, schedule=schedule, **kw), max_steps=max_steps)
    lrs = []
    for _ in range(max_steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_every_schedule_warms_up_from_a_nonzero_lr_and_never_wastes_an_update():
    for schedule in ("cosine", "linear", "constant_with_warmup", "warmup_stable_decay"):
        lrs = _lrs(schedule, warmup_steps=4, min_lr_ratio=0.0)
        assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]), schedule
        assert all(lr > 0 for lr in lrs), schedule  # the last update still moves, even decaying to 0
    assert _lrs("constant", warmup_steps=4) == pytest.approx([1.0] * 20)  # no warmup at all
    assert _lrs("constant_with_warmup", warmup_steps=4)[4:] == pytest.approx([1.0] * 16)


def test_cosine_and_linear_decay_monotonically_to_their_floor():
    cos = _lrs("cosine", warmup_steps=2, min_lr_ratio=0.1)
    lin = _lrs("linear", warmup_steps=2)
    for lrs in (cos, lin):
        assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))
    assert 0.1 < cos[-1] < 0.11  # one step before the floor (the horizon is max_steps + 1)
    assert lin[-1] == pytest.approx(1 / 19)  # linear: (horizon - step) / (horizon - warmup) = 1 / 19


def test_warmup_stable_decay_holds_the_peak_then_decays_over_the_last_fraction():
    lrs = _lrs("warmup_stable_decay", max_steps=20, warmup_steps=2, decay_fraction=0.25, min_lr_ratio=0.1)
    # decay: the last 5 of 21 schedule steps (indices 16..20); updates 0..19 use steps 1..20
    assert lrs[1:15] == pytest.approx([1.0] * 14)
    assert all(a > b for a, b in itertools.pairwise(lrs[15:])) and lrs[-1] >= 0.1 and lrs[-1] < 0.3


def test_unknown_schedule_names_the_choices():
    with pytest.raises(UserError, match="optim.schedule.*warmup_stable_decay"):
        OptimConfig(schedule="poly")


def test_warmup_ratio_scales_with_the_run_and_excludes_warmup_steps():
    """optim.warmup_ratio warms up for that fraction of train.max_steps; together with warmup_steps it is refused."""
    lrs = _lrs("cosine", max_steps=20, warmup_ratio=0.2, min_lr_ratio=0.1)  # 4 warmup steps
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and lrs[-1] < lrs[4]
    assert _lrs("linear", max_steps=40, warmup_ratio=0.1)[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    with pytest.raises(UserError, match=r"optim.warmup_steps=10 and optim.warmup_ratio=0.1 are both set"):
        OptimConfig(warmup_steps=10, warmup_ratio=0.1)
    with pytest.raises(UserError, match=r"optim.warmup_ratio=1.0 must be in \[0, 1\)"):
        OptimConfig(warmup_ratio=1.0)
    assert OptimConfig().warmup_for(1000) == 10  # neither set: the old default


def test_composed_warmup_ratio_needs_no_warmup_steps_override():
    """The shipped optim config leaves warmup_steps null, so optim.warmup_ratio alone composes (over a model
    config's warmup_steps too: tests/cli/test_first_contact.py)."""
    from flexengine.cli.common import compose_job

    assert compose_job(["optim.warmup_ratio=0.05"]).optim.warmup_for(200) == 10


def test_warmup_as_long_as_the_run_is_reported():
    """max_steps <= warmup: a decaying schedule ends at the peak lr (no decay), so the run says so."""
    from flexengine.loop.optim import schedule_problem

    assert _lrs("cosine", max_steps=5, warmup_steps=10)[-1] == pytest.approx(1.0)  # the peak, never decayed
    problem = schedule_problem(OptimConfig(warmup_steps=10), max_steps=8)
    assert "optim.warmup_steps=10 >= train.max_steps=8" in problem and "never leaves warmup" in problem
    assert "never reaches the peak" in schedule_problem(OptimConfig(schedule="constant_with_warmup"), 5)
    assert "warmup_ratio" in schedule_problem(OptimConfig(warmup_ratio=0.9), max_steps=2)
    assert schedule_problem(OptimConfig(warmup_steps=10), max_steps=11) == ""
    assert schedule_problem(OptimConfig(schedule="constant", warmup_steps=10), max_steps=5) == ""
    assert schedule_problem(OptimConfig(schedule="constant_with_warmup", warmup_steps=5), max_steps=5) == ""


def _resumed_lrs(done: int, first: int, then: int, how: str, **kw) -> tuple[list[float], list[float]]:
    """(the lrs of a run of `first` steps up to `done`, those after resuming there with max_steps=`then`): the
    resume as the checkpointer does it, through the scheduler's saved state."""
    from flexengine.loop.optim import apply_knots, resumed_knots

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    config = OptimConfig(lr=1.0, **kw)
    sched = build_scheduler(opt, config, max_steps=first)
    before = []
    for _ in range(done):
        before.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD([p], lr=1.0)
    opt2.load_state_dict(opt.state_dict())
    resumed = build_scheduler(opt2, config, max_steps=then)
    resumed.load_state_dict(state)
    apply_knots(resumed, config, resumed_knots(state["knots"], done, then, how))
    after = []
    for _ in range(then - done):
        after.append(opt2.param_groups[0]["lr"])
        opt2.step()
        resumed.step()
    return before, after


@pytest.mark.parametrize("schedule", ["cosine", "linear", "warmup_stable_decay"])
def test_a_longer_resume_continues_the_schedule_from_where_it_was(schedule):
    """train.resume_schedule=continue: no jump at the resume, the warmup and decay keep their shape over the longer
    remainder, and the run still ends where the schedule ends; rederive jumps to the new schedule's lr."""
    kw = {"schedule": schedule, "warmup_steps": 4, "min_lr_ratio": 0.1}
    straight = _lrs(max_steps=20, **kw)
    before, after = _resumed_lrs(10, 20, 40, "continue", **kw)
    assert before == pytest.approx(straight[:10])  # the saved run itself is unchanged
    steps = before[-1] - after[0], straight[9] - straight[10]
    assert 0 <= steps[0] <= steps[1] + 1e-12  # no jump: a smaller step than the planned run's own
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(before[4:] + after))  # never climbs back
    assert after[-1] == pytest.approx(straight[-1], rel=0.05)  # ends where the schedule ends
    _, rederived = _resumed_lrs(10, 20, 40, "rederive", **kw)
    assert rederived == pytest.approx(_lrs(max_steps=40, **kw)[10:])


def test_a_resume_inside_warmup_finishes_the_same_warmup_without_a_dip():
    """Before: a 6-step run wholly inside a 50-step warmup, resumed to 8 steps, went 2e-5, 1.75e-5, 2e-5
    (the warmup was capped to the new length); continuing keeps climbing or holds, never dips."""
    before, after = _resumed_lrs(6, 6, 8, "continue", warmup_steps=50)
    assert before[-1] == pytest.approx(1.0)  # capped: the 6-step run warms up to the peak at its last step
    assert after == pytest.approx([1.0, 1.0])  # finished: its last lr holds
    before, after = _resumed_lrs(3, 6, 12, "continue", warmup_steps=50)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(before + after))  # still warming up, stretched
    _, dip = _resumed_lrs(6, 6, 8, "rederive", warmup_steps=50)
    assert dip == pytest.approx([7 / 8, 1.0])  # what rederive means: the schedule of 8 steps


def test_a_resumed_schedule_is_described_as_planned_and_where_it_resumed():
    optim = OptimConfig(lr=1e-3, warmup_steps=1)
    same = describe_resumed_schedule(optim, 6, [[0, 0], [6, 6]], 3, 4.5e-4)
    assert same.startswith("optim.schedule=cosine over 6 steps") and same.endswith("step 4 runs at lr 0.00045")
    stretched = describe_resumed_schedule(optim, 12, [[0, 0], [3, 3], [12, 6]], 3, 5.8e-4)
    assert stretched.endswith("(the rest of the 6-step schedule stretched to train.max_steps=12)")
    held = describe_resumed_schedule(optim, 30, [[0, 0], [3, 3]], 3, 1e-4)
    assert held.endswith("(the 3-step schedule had finished: its last lr holds to train.max_steps=30)")
