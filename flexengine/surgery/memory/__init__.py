"""Activation memory per decoder block: checkpoint / SAC / CPU offload policies, a meter, and a planner."""

from flexengine.surgery.memory.layers import decoder_layers, select_layers
from flexengine.surgery.memory.meter import ActivationReport, measure_activations
from flexengine.surgery.memory.policy import apply_memory_policy
from flexengine.surgery.memory.spec import MemorySpec, Recompute, block_memory_specs

__all__ = [
    "ActivationReport",
    "MemorySpec",
    "Recompute",
    "apply_memory_policy",
    "block_memory_specs",
    "decoder_layers",
    "measure_activations",
    "select_layers",
]
