"""NaN/Inf found before a checkpoint is written (flexengine/loop/nonfinite.py), and told with the optim.* setting
most likely to blame."""

from __future__ import annotations

import torch

from flexengine.core.config import OptimConfig
from flexengine.loop.nonfinite import nonfinite_message, nonfinite_names, optimizer_tensors, suspect_settings


def test_only_floating_tensors_holding_nan_or_inf_are_named():
    named = [
        ("fine", torch.randn(4)),
        ("nan", torch.tensor([1.0, float("nan")])),
        ("inf", torch.tensor([float("inf")])),
        ("minus_inf_bf16", torch.tensor([-float("inf"), 2.0], dtype=torch.bfloat16)),
        ("huge_but_finite", torch.full((1000,), 3e38)),  # its 2-norm would overflow; its max does not
        ("ints", torch.tensor([2**62])),  # not floating point: skipped
        ("empty", torch.empty(0)),
        ("param", torch.nn.Parameter(torch.tensor([float("nan")]))),
    ]
    assert nonfinite_names(named) == ["nan", "inf", "minus_inf_bf16", "param"]
    assert nonfinite_names([]) == []


def test_optimizer_states_are_named_after_their_parameter():
    named, unnamed = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([named, unnamed], lr=0.1)
    (named.sum() + unnamed.sum()).backward()
    opt.step()
    tensors = optimizer_tensors(opt, {id(named): "w"})
    names = [name for name, _ in tensors]
    assert names == [f"optimizer {k} of {p}" for p in ("w", "#1") for k in ("step", "exp_avg", "exp_avg_sq")]
    assert tensors[1][1] is opt.state[named]["exp_avg"]


def test_each_suspect_setting_is_named_with_what_to_try():
    bad = OptimConfig(lr=0.5, grad_clip=0, eps=1e-12, weight_decay=2.0)
    assert suspect_settings(bad) == "; ".join(
        [
            "optim.lr=0.5 is high for fine-tuning (try 1e-4 or lower)",
            "optim.grad_clip=0 turns clipping off (one large gradient can blow the weights up; try 1.0)",
            "optim.eps=1e-12 is tiny: Adam divides by sqrt(v) + eps (try 1e-8)",
            "optim.lr x optim.weight_decay = 1 >= 1 flips the weights",
        ]
    )


def test_sane_settings_point_at_the_data_instead():
    text = suspect_settings(OptimConfig(lr=2e-5, grad_clip=1.0, eps=1e-8, weight_decay=0.1))
    assert text.startswith("no optim.* value looks out of range (lr 2e-05, grad_clip 1, eps 1e-08, weight_decay 0.1)")


def test_the_refusal_names_three_tensors_at_most_or_another_rank():
    optim = OptimConfig(lr=2e-5)
    five = nonfinite_message(7, ["a", "b", "c", "d", "e"], optim)
    assert five.startswith("step 7: 5 tensor(s) hold NaN/Inf (a, b, c, ...), so its checkpoint was not written")
    assert nonfinite_message(7, ["a"], optim).startswith("step 7: 1 tensor(s) hold NaN/Inf (a), so")
    assert "another rank's weights or optimizer states hold NaN/Inf" in nonfinite_message(7, [], optim)
