"""Activation memory per decoder block: checkpoint / SAC / CPU offload applied from one MemorySpec per block, the
recompute kinds, tiled MLP and a meter of the bytes saved for backward (the planner that chooses is planning/).

The names below are imported on first use (PEP 562, as the attention package does): composing a job checks
memory.granularity against `kinds.KINDS` (`kinds.check_granularity`), and importing this package for that must not
pull in torch (tests/cli/test_common.py checks that composing a job loads neither torch nor transformers).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the type checker reads the real names; at run time __getattr__ imports them
    from flexengine.surgery.memory.layers import decoder_layers, select_layers
    from flexengine.surgery.memory.meter import ActivationReport, measure_activations
    from flexengine.surgery.memory.policy import apply_memory_policy
    from flexengine.surgery.memory.spec import MemorySpec, Recompute, block_memory_specs

_PACKAGE = "flexengine.surgery.memory"
_LAZY = {  # public name -> the submodule that defines it
    "ActivationReport": "meter",
    "MemorySpec": "spec",
    "Recompute": "spec",
    "apply_memory_policy": "policy",
    "block_memory_specs": "spec",
    "decoder_layers": "layers",
    "measure_activations": "meter",
    "select_layers": "layers",
}

__all__ = [  # written out (not sorted(_LAZY)) so that linters see what the TYPE_CHECKING imports export
    "ActivationReport",
    "MemorySpec",
    "Recompute",
    "apply_memory_policy",
    "block_memory_specs",
    "decoder_layers",
    "measure_activations",
    "select_layers",
]


def __getattr__(name: str) -> Any:
    """PEP 562: import a public name's submodule when the name is first asked for."""
    if name in _LAZY:
        value = getattr(import_module(f"{_PACKAGE}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
