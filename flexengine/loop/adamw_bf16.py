"""precision=bf16_sr's optimizer (optim.name=adamw_bf16): torchao's AdamW over bf16 weights with stochastic
rounding, whose second moment is kept in fp32. Imported only when torchao is (flexengine.loop.optim checks).

torchao stores both AdamW states in the weights' dtype with round-to-nearest. exp_avg_sq then cannot fall: at
beta2 = 0.999 a step lowers it by at most 0.1 %, under half a bf16 ulp (>= 0.2 %), so once the gradient scale
falls v stays too large and every step too small (0.79x fp32 AdamW's mean step after 3,000 steps of a halving
scale; bench/results/optim_numerics.md). An fp32 exp_avg_sq follows it for 2 more bytes per parameter (6 in all).
exp_avg stays bf16: at beta1 = 0.9 a step moves it by 10 % of the gap, far above an ulp, and its rounding errors
average out in the weights' stochastic rounding.
"""

from __future__ import annotations

import torch
from torchao.optim import _AdamW


class AdamWBF16(_AdamW):
    """torchao AdamW: bf16 weights updated with stochastic rounding, bf16 exp_avg, fp32 exp_avg_sq."""

    def __init__(self, params, **adamw_kwargs):
        super().__init__(params, bf16_stochastic_round=True, **adamw_kwargs)

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        # torchao's hook for a state's storage: signed = exp_avg, unsigned = exp_avg_sq (and amsgrad's max)
        buffer = super()._new_buffer(p, signed)
        return buffer if signed else buffer.float()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load, keeping the saved fp32 second moments: torch casts every loaded state to its parameter's dtype."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved_sq = {i: s["exp_avg_sq"] for i, s in state_dict["state"].items() if "exp_avg_sq" in s}
        # torch would first cast each exp_avg_sq to the bf16 weights on the device (2 B/param, 12.9 GiB at 7B on a
        # plan with ~0.3 GiB headroom) only for it to be replaced: the parent never sees it (the caller's dict
        # is left whole: only shallow copies lose the key)
        without_sq = {i: {k: v for k, v in s.items() if k != "exp_avg_sq"} for i, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": without_sq})
        params = dict(zip(saved_ids, (p for group in self.param_groups for p in group["params"])))
        for i, sq in saved_sq.items():
            self.state[params[i]]["exp_avg_sq"] = sq.to(params[i].device, torch.float32, copy=True)
