"""Activation-memory policies applied per decoder block (checkpointing now; selective/offload build on it)."""

from flexengine.memory.policy import apply_memory_policy, decoder_layers, select_layers

__all__ = ["apply_memory_policy", "decoder_layers", "select_layers"]
