"""The optimizers `optim.name` picks, one `OptimizerSpec` each: how the loop builds it, what it stores for the
planner, where its update runs, and the precision modes and weights it takes. `OPTIMIZERS` is the only list:
composition checks optim.name against it, surgery/precision.py reads its bytes and modes, loop/optim.py builds it.

A spec names its builder (`module:function`) rather than importing it: this module sits in core, below the loop
that holds the optimizers, and composing a job must load no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flexengine.core.errors import UserError

# torchao AdamW8bit keeps one fp32 scale per block of 256 values, for each of its two states
AO_8BIT_BLOCK = 256


@dataclass(frozen=True)
class OptimizerSpec:
    """One optim.name. Bytes are per trainable parameter; under FSDP they shard like the parameters."""

    build: str  # "module:function" of its builder: (param_groups, hyper, *, model, optim, device) -> optimizer
    states_in_param_dtype: int = 0  # device states stored in the parameter's own dtype (AdamW: exp_avg, exp_avg_sq)
    state_bytes: float = 0.0  # device state bytes besides those (fixed-dtype or quantised states)
    host_bytes: float = 0.0  # host bytes: fp32 masters and states (the transfer slot is the precision mode's)
    steps_on_host: bool = False  # the update runs on the CPU: gradients come down, weights go up every step
    package: str = ""  # what it needs beyond torch ("" = nothing); named in the error when it is missing
    # weight dtypes of the precision modes whose AdamW (optim.name's default) it may replace; () = none: only a
    # mode that names it as its own optimizer takes it
    stands_in_for_adamw: tuple[str, ...] = ()
    param_dtypes: tuple[str, ...] = ()  # trainable weight dtypes it takes (torch dtype names; () = any)
    other_dtypes_hint: str = ""  # what to do instead when the weights are another dtype
    embedding_state_bytes: Optional[float] = None  # per input-embedding element, in place of the above there


OPTIMIZERS = {
    # torch AdamW: exp_avg + exp_avg_sq in the parameter dtype
    "adamw": OptimizerSpec("flexengine.loop.optim:build_adamw", states_in_param_dtype=2),
    # torchao AdamW8bit: block-quantised 8-bit states; the input embedding keeps fp32 exp_avg + exp_avg_sq
    "adamw_8bit": OptimizerSpec(
        "flexengine.loop.optim:build_adamw_8bit",
        state_bytes=2.0 * (1 + 4 / AO_8BIT_BLOCK),
        package="torchao",
        stands_in_for_adamw=("float32", "bfloat16"),
        embedding_state_bytes=8.0,
    ),
    # torchao AdamW, stochastic rounding of bf16 weights: bf16 exp_avg + fp32 exp_avg_sq (loop/adamw_bf16.py)
    "adamw_bf16": OptimizerSpec(
        "flexengine.loop.optim:build_adamw_bf16",
        state_bytes=2.0 + 4.0,
        package="torchao",
        param_dtypes=("bfloat16",),
        other_dtypes_hint="use precision=bf16_sr (bf16 weights with this optimizer)",
    ),
    # fp32 master + two fp32 states in host memory, the step on the CPU (loop/host_adamw.py)
    "adamw_cpu_offload": OptimizerSpec(
        "flexengine.loop.optim:build_adamw_cpu_offload",
        host_bytes=4.0 + 8.0,
        steps_on_host=True,
        stands_in_for_adamw=("float32",),  # with bf16 weights it is bf16_cpu_master's own
    ),
}


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of optim.name, or a UserError listing the names there are."""
    if name not in OPTIMIZERS:
        raise UserError(f"optim.name={name!r} is not valid; choose one of {', '.join(OPTIMIZERS)}.")
    return OPTIMIZERS[name]
