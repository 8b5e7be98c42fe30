"""flexengine/core/optimizers.py: one OptimizerSpec per optim.name. Each shipped optimizer builds what its spec
says (where it steps, the weights it takes); an optimizer added as one entry alone (a test-only SGD with momentum)
composes, is priced by the planner as many bytes as it allocates, and trains two steps through flexengine.train."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from flexengine.core.config import OptimConfig
from flexengine.core.errors import UserError
from flexengine.core.optimizers import OPTIMIZERS, OptimizerSpec, optimizer_spec
from flexengine.loop.optim import StepsOnHost, build_optimizer
from flexengine.surgery.precision import auto_order, precision_spec
from tests.helpers import make_job, make_llama

CPU = torch.device("cpu")
BUILT: list[torch.optim.Optimizer] = []  # what build_sgd made, for the test to look at


def build_sgd(groups, hyper, **_):
    """The test-only optimizer's builder: torch SGD with momentum (one state per parameter, in its dtype)."""
    BUILT.append(torch.optim.SGD(groups, lr=hyper["lr"], momentum=0.9))
    return BUILT[-1]


SGD = OptimizerSpec("tests.core.test_optimizers:build_sgd", states_in_param_dtype=1, stands_in_for_adamw=("float32",))


@pytest.fixture
def sgd(monkeypatch):
    """OPTIMIZERS with the test-only optimizer as one more entry, and nothing else changed."""
    monkeypatch.setitem(OPTIMIZERS, "sgd_momentum", SGD)
    BUILT.clear()
    return "sgd_momentum"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_shipped_optimizer_builds_what_its_spec_says(name):
    spec = optimizer_spec(name)
    if spec.package and importlib.util.find_spec(spec.package) is None:
        pytest.skip(f"{spec.package} is not installed")
    model = make_llama()
    if spec.param_dtypes:
        with pytest.raises(UserError, match=rf"optim.name={name} takes .* but the model's are float32"):
            build_optimizer(model, OptimConfig(name=name), CPU)
        model = model.to(getattr(torch, spec.param_dtypes[0]))
    opt = build_optimizer(model, OptimConfig(name=name), CPU)
    assert isinstance(opt, StepsOnHost) == spec.steps_on_host  # the loop's host path follows the spec
    assert auto_order(on_cuda=False, optimizer=name)  # some precision mode takes it


def test_an_unknown_name_is_refused_listing_the_table():
    with pytest.raises(UserError, match=r"optim.name='sgd' is not valid; choose one of adamw, adamw_8bit"):
        optimizer_spec("sgd")
    with pytest.raises(UserError, match="optim.name='sgd' is not valid"):
        OptimConfig(name="sgd")


def test_a_new_optimizer_is_one_entry_the_planner_prices_as_it_allocates(sgd, tmp_path):
    from flexengine.core.hardware import assumed_hardware
    from flexengine.planning import costs
    from flexengine.planning.shapes import ModelShape
    from tests.helpers import plan_inputs_of

    job = make_job(tmp_path, f"optim.name={sgd}", "precision=fp32")  # composition takes the new name
    assert auto_order(on_cuda=False, optimizer=sgd) == ("fp32", "bf16_mixed")  # the fp32-weight modes
    with pytest.raises(UserError, match=f"precision=bf16_pure needs optim.name=adamw or adamw_8bit, not .*={sgd}"):
        precision_spec("bf16_pure", sgd)
    spec = precision_spec("fp32", sgd)
    assert spec.optimizer == sgd and spec.bytes_per_param()["optimizer"] == 4.0  # one fp32 momentum buffer
    model = make_llama()
    planned = costs.static_bytes(
        ModelShape.from_hf_config(model.config),
        plan_inputs_of(job, assumed_hardware(job.hardware), spec, hf_config=model.config),
    )["optimizer_bytes"]
    opt = build_optimizer(model, job.optim, CPU)
    model(input_ids=torch.randint(0, 256, (1, 8)), labels=torch.randint(0, 256, (1, 8))).loss.backward()
    opt.step()
    held = sum(s["momentum_buffer"].numel() * 4 for s in opt.state.values())
    assert planned == held == 4 * sum(p.numel() for p in model.parameters())


def test_a_new_optimizer_trains_two_steps_through_the_loop(sgd, tmp_path):
    from flexengine.run import run_training

    summary = run_training(make_job(tmp_path, f"optim.name={sgd}", "train.max_steps=2"), tmp_path)
    assert summary["steps"] == 2 and all(math.isfinite(loss) for loss in summary["losses"])
    assert summary["config"]["optim"]["name"] == sgd and summary["config"]["precision"]["mode"] == "fp32"
    (opt,) = BUILT
    assert opt.state and all(s["momentum_buffer"].abs().sum() > 0 for s in opt.state.values())  # it stepped
