"""Which decoder blocks recompute their activations in backward, applied in place to an HF model."""

from __future__ import annotations

import logging

from torch import nn
from torch.utils.checkpoint import checkpoint

from flexengine.config import MemoryConfig
from flexengine.errors import UserError

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks (HF causal LMs keep it at get_decoder().layers)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UserError(f"{type(model).__name__}: cannot find its decoder blocks (expected get_decoder().layers)")
    return layers


def select_layers(spec: str, n_layers: int) -> list[int]:
    """Block indices for memory.layers: all | every_<n> | first_<k> | last_<k> | "0,3,7"."""
    spec = str(spec).strip()
    try:
        if spec == "all":
            return list(range(n_layers))
        if spec.startswith("every_"):
            n = int(spec[len("every_"):])
            return list(range(n - 1, n_layers, n)) if n > 0 else []
        if spec.startswith("first_"):
            return list(range(min(int(spec[len("first_"):]), n_layers)))
        if spec.startswith("last_"):
            k = int(spec[len("last_"):])
            return list(range(max(0, n_layers - k), n_layers))
        if spec in ("", "none"):
            return []
        indices = sorted({int(i) for i in spec.split(",")})
    except ValueError:
        raise UserError(f"memory.layers={spec!r}: use all, every_<n>, first_<k>, last_<k> or a list like 0,3,7") from None
    bad = [i for i in indices if not 0 <= i < n_layers]
    if bad:
        raise UserError(f"memory.layers={spec!r}: blocks {bad} do not exist (the model has {n_layers}: 0..{n_layers - 1})")
    return indices


def _checkpoint_forward(layer: nn.Module) -> None:
    inner = layer.forward

    def forward(*args, **kwargs):
        # non-reentrant: works with kwargs, compile and activation offload hooks
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward  # instance attribute: parameter names and state_dict keys stay HF's


def apply_memory_policy(model: nn.Module, memory: MemoryConfig) -> list[int]:
    """Apply memory.policy to the selected blocks in place; returns the indices of the blocks it changed."""
    if memory.policy == "none":
        return []
    if memory.policy != "full":
        raise UserError(f"memory.policy={memory.policy!r} is not available yet; use none or full")
    layers = decoder_layers(model)
    chosen = select_layers(memory.layers, len(layers))
    for i in chosen:
        _checkpoint_forward(layers[i])
    log.info("memory: checkpointing %d of %d blocks %s", len(chosen), len(layers), chosen)
    return chosen
