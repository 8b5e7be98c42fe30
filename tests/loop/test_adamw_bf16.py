"""precision=bf16_sr's optimizer (flexengine/loop/adamw_bf16.py): torchao's AdamW with a bf16 first moment and an
fp32 second moment, kept fp32 through save and load, and its compiled step (what the loop runs on the GPU) against
the eager one. Its long-horizon numerics are tested with every mode's in tests/loop/test_optim_numerics.py."""

from __future__ import annotations

import pytest
import torch


def test_adamw_bf16_keeps_an_fp32_second_moment_through_save_and_load():
    pytest.importorskip("torchao")
    from flexengine.loop.adamw_bf16 import AdamWBF16

    def stepped(seed: int):
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(4))]
        params[1].data = params[1].data.bfloat16()
        opt = AdamWBF16([{"params": params[:1]}, {"params": params[1:]}], lr=1e-3, betas=(0.9, 0.999))
        return params, opt

    params, opt = stepped(0)
    with torch.compiler.set_stance("force_eager"):
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    saved = opt.state_dict()
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in opt.state.values())
    _, fresh = stepped(1)
    cast = []  # torch's load casts each state to the param dtype: a transient bf16 exp_avg_sq
    policy = torch.optim.Optimizer._process_value_according_to_param_policy

    def spy(param, value, param_id, param_groups, key=None):
        cast.append(key)
        return policy(param, value, param_id, param_groups, key)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(spy))
        fresh.load_state_dict(saved)  # torch's load would cast exp_avg_sq to the bf16 weights' dtype
    assert "exp_avg" in cast and "exp_avg_sq" not in cast, cast
    assert all("exp_avg_sq" in s for s in saved["state"].values())  # the caller's dict is left whole
    for before, after in zip(opt.state.values(), fresh.state.values()):
        assert after["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(after["exp_avg_sq"], before["exp_avg_sq"])
        assert torch.equal(after["exp_avg"], before["exp_avg"])
    for _ in range(2):  # and both go on bitwise (same grads, same SR draws)
        grads = [torch.randn_like(p) for p in params]
        for o, ps in ((opt, params), (fresh, [p for g in fresh.param_groups for p in g["params"]])):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            torch.manual_seed(7)
            with torch.compiler.set_stance("force_eager"):
                o.step()
    for before, after in zip(opt.state.values(), fresh.state.values()):
        assert torch.equal(after["exp_avg_sq"], before["exp_avg_sq"]) and torch.equal(
            after["exp_avg"], before["exp_avg"]
        )


def _within_one_bf16_ulp(x: torch.Tensor, y: torch.Tensor, floor: float = 0.0) -> bool:
    """|x - y| <= one bf16 ulp at the larger of |x|, |y| (8 significant bits; frexp's mantissa is in [0.5, 1)),
    or <= floor."""
    x, y = x.float(), y.float()
    _, exponent = torch.frexp(torch.maximum(x.abs(), y.abs()))
    ulp = torch.ldexp(torch.ones_like(x), exponent - 8)
    return bool(((x - y).abs() <= ulp.clamp(min=floor)).all())


@pytest.mark.slow  # one inductor C++ build of torchao's step: ~15-40 s on a shared 2-core machine
def test_compiled_adamw_bf16_step_matches_the_eager_one(tmp_path, monkeypatch):
    """What the loop runs on the GPU -- torchao's torch.compile(single_param_adam) over a bf16
    exp_avg, the fp32 exp_avg_sq and inductor's stochastic rounding -- against the same step run eagerly (what
    every other test runs). Built as the loop builds it (build_optimizer). Per step, from the same weights and
    gradients: the moments (deterministic) agree to fp32 rounding, the weights by at most one bf16 ulp (each path
    rounds the same fp32 update down or up at random), and sub-ulp updates still move some weights (rounding is
    stochastic when compiled too, not to nearest)."""
    pytest.importorskip("torchao")
    from flexengine.core.config import OptimConfig
    from flexengine.loop.optim import build_optimizer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold build: what a run meets
    torch._dynamo.reset()
    torch.manual_seed(0)

    def model() -> torch.nn.Module:  # one shape, one decay group: one compiled graph
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(2))).to(torch.bfloat16)

    config = OptimConfig(name="adamw_bf16", lr=1e-4, weight_decay=0.1, betas=(0.9, 0.999))
    compiled_model, eager_model = model(), model()
    compiled = build_optimizer(compiled_model, config, torch.device("cpu"))
    eager = build_optimizer(eager_model, config, torch.device("cpu"))
    start = [p.detach().clone() for p in compiled_model.parameters()]
    torch._dynamo.utils.counters.clear()
    for step in range(3):
        for a, b in zip(compiled_model.parameters(), eager_model.parameters()):
            b.data.copy_(a.data)  # the same weights in: only this step's rounding may differ
            a.grad = torch.randn_like(a) * 10.0**-step  # falling scale: exp_avg_sq must follow in fp32
            b.grad = a.grad.clone()
        compiled.step()
        with torch.compiler.set_stance("force_eager"):
            eager.step()
        for a, b in zip(compiled_model.parameters(), eager_model.parameters()):
            sa, sb = compiled.state[a], eager.state[b]
            assert sa["exp_avg_sq"].dtype == torch.float32 and sa["exp_avg"].dtype == torch.bfloat16
            torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-6, atol=0)
            # bf16 exp_avg: one ulp, or a near-cancelled lerp (inductor's 0.0 where eager's is 2e-10, measured)
            assert _within_one_bf16_ulp(sa["exp_avg"], sb["exp_avg"], 1e-6 * float(sb["exp_avg"].abs().max()))
            assert _within_one_bf16_ulp(a, b), (step, (a.float() - b.float()).abs().max())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile (no eager fallback)
    # steps of ~lr = 1e-4: at |w| >= 1/16 a bf16 ulp is >= 4.9e-4, so rounding to nearest never moves such a
    # weight; stochastic rounding moves each with probability ~ step / ulp (about one in five here)
    moved = [(p.detach() != s)[s.abs() >= 2**-4] for p, s in zip(compiled_model.parameters(), start)]
    assert 0 < sum(int(m.sum()) for m in moved) < sum(m.numel() for m in moved)
