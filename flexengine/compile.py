"""torch.compile each decoder block (fullgraph), after memory wrappers and before FSDP."""

from __future__ import annotations

import logging

from torch import nn

from flexengine.memory import decoder_layers

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """Compile every decoder block in place; blocks share one graph, so compile time does not grow with depth."""
    layers = decoder_layers(model)
    for layer in layers:
        # fullgraph: a graph break inside a block is a bug we want to see, not a silent slowdown
        layer.compile(backend=backend, fullgraph=True)
    log.info("compile: %d decoder blocks with backend=%s (fullgraph)", len(layers), backend)
