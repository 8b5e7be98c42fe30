"""The decoder blocks of an HF causal LM, and which of them memory.layers selects."""

from __future__ import annotations

from torch import nn

from flexengine.core.errors import UserError
from flexengine.surgery.family import family_of


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks (where its family keeps them: flexengine.surgery.family)."""
    return family_of(model).decoder_layers(model)


def select_layers(spec: str, n_layers: int) -> list[int]:
    """Block indices for memory.layers: all | every_<n> | first_<k> | last_<k> | spread_<k> | "0,3,7"."""
    spec = str(spec).strip()
    try:
        if spec == "all":
            return list(range(n_layers))
        if spec.startswith("spread_"):  # k blocks spread evenly: block i of k sits at (i + 1/2) n / k
            k = min(int(spec[len("spread_") :]), n_layers)
            return [int((i + 0.5) * n_layers / k) for i in range(k)]
        if spec.startswith("every_"):
            n = int(spec[len("every_") :])
            return list(range(n - 1, n_layers, n)) if n > 0 else []
        if spec.startswith("first_"):
            return list(range(min(int(spec[len("first_") :]), n_layers)))
        if spec.startswith("last_"):
            k = int(spec[len("last_") :])
            return list(range(max(0, n_layers - k), n_layers))
        if spec in ("", "none"):
            return []
        indices = sorted({int(i) for i in spec.split(",")})
    except ValueError:
        raise UserError(
            f"memory.layers={spec!r}: use all, every_<n>, first_<k>, last_<k>, spread_<k> or a list of blocks, "
            "quoted for Hydra: 'memory.layers=\"0,3,7\"'"
        ) from None
    bad = [i for i in indices if not 0 <= i < n_layers]
    if bad:
        raise UserError(
            f"memory.layers={spec!r}: blocks {bad} do not exist (the model has {n_layers}: 0..{n_layers - 1})"
        )
    return indices
