"""`model.flexengine`: the one declared record of what flexengine's model surgery did to a model.

Each `apply_*` step fills its own field; readers (trainer, doctor, planner report, tests) read this record
instead of probing loose attributes or re-parsing the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

if TYPE_CHECKING:  # types only: this module sits below attention/ and memory/
    from flexengine.surgery.attention.spec import AttentionSpec
    from flexengine.surgery.memory.spec import MemorySpec

ATTRIBUTE = "flexengine"


@dataclass
class Applied:
    """What was done to the model, in surgery order."""

    # precision.apply_precision: the PrecisionSpec the weights are stored for (typed Any: precision.py imports this
    # module to record itself, so naming its class here, even for type checkers only, would close a circle)
    precision: Any = None
    attention: Optional["AttentionSpec"] = None  # apply_attention (None: HF's attention untouched)
    memory: tuple["MemorySpec", ...] = ()  # apply_memory_policy: one spec per decoder block
    compile_backend: Optional[str] = None  # apply_compile: the torch.compile backend of the decoder blocks
    compile_probe: Any = None  # apply_compile: the BlockCompileProbe counting blocks that ran uncompiled
    fsdp_policy: Any = None  # apply_fsdp: the MixedPrecisionPolicy it sharded with (None: no cast by FSDP)
    mask_hook: Any = None  # the decoder's forward pre-hook that builds a batch's masks (RemovableHandle)
    offload: Any = None  # the OffloadManager shared by offloaded blocks (one side stream per model)


def applied(model: nn.Module) -> Applied:
    """The model's record, created empty on first use."""
    record = model.__dict__.get(ATTRIBUTE)
    if record is None:
        record = Applied()
        model.__dict__[ATTRIBUTE] = record  # a plain attribute: not a submodule, parameter or buffer
    return record


def attention_spec(model: nn.Module) -> Optional["AttentionSpec"]:
    """The attention spec applied to `model`, or None if its attention is HF's own and untouched."""
    record = model.__dict__.get(ATTRIBUTE)
    return record.attention if record is not None else None
