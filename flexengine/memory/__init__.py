"""Activation memory per decoder block: checkpoint / SAC / CPU offload policies, a meter, and a planner."""

from flexengine.memory.meter import ActivationReport, measure_activations
from flexengine.memory.policy import apply_memory_policy, decoder_layers, select_layers

__all__ = ["ActivationReport", "apply_memory_policy", "decoder_layers", "measure_activations", "select_layers"]
