"""Attention rewrite: the resolved spec, mask functions, per-batch masks, and the patch that routes HF attention.

The names below are imported on first use (PEP 562, as flexengine/__init__.py does): composing a job imports
`job_rules` -> `masks` only, and importing this package must not pull in patch.py's transformers or
block_mask.py's FlexAttention (tests/cli/test_common.py checks that composing a job loads neither torch nor
transformers). The function `mask_mode` is not among them: `from flexengine.surgery.attention.mask_mode import
mask_mode` (the package attribute of that name is its submodule).
"""

from importlib import import_module

_PACKAGE = "flexengine.surgery.attention"
# each submodule -> the public names it defines. Not the function `mask_mode`: it shares its module's name, and once
# the submodule is imported the package attribute `mask_mode` is the module, so take it from .mask_mode itself.
_MODULE_NAMES = {
    "block_mask": ("BatchMask", "DenseMask", "FlexMask", "VarlenMask", "build_batch_mask"),
    "mask_mode": ("MaskMode", "get_mask_mod"),
    "masks": (
        "Causal",
        "InnerMask",
        "SlidingWindow",
        "document_ids_from_position_ids",
        "position_ids_from_document_ids",
    ),
    "patch": ("MASK_KWARG", "LayerMasks", "apply_attention", "mask_kwargs", "patch_attention"),
    "spec": ("AttentionSpec", "AttnBackend", "resolve_attention_spec", "resolve_backend"),
}
_LAZY = {name: module for module, names in _MODULE_NAMES.items() for name in names}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    """PEP 562: import a public name's submodule when the name is first asked for."""
    if name in _LAZY:
        value = getattr(import_module(f"{_PACKAGE}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
