"""flexengine: long-context fine-tuning of HF causal LMs with FlexAttention document masks.

Public API:
    batch = flexengine.pack_documents(docs, seq_len=4096)   # dict of LongTensors [rows, seq_len]
    model = flexengine.patch_attention(model, mode="packed_doc", backend="auto")   # or, from configs:
    flexengine.apply_attention(model, flexengine.resolve_attention_spec(AttnConfig(...), model.config))

All are imported on first use: `import flexengine.cli` (every command's start) must not pay for torch and
transformers (measured: most of a command's start-up, see bench/results/startup.md).
"""

from importlib import import_module

__all__ = ["apply_attention", "pack_documents", "patch_attention", "resolve_attention_spec"]
__version__ = "0.1.0"

_LAZY = {"pack_documents": "flexengine.data.packing", "patch_attention": "flexengine.attention.patch",
         "apply_attention": "flexengine.attention.patch", "resolve_attention_spec": "flexengine.attention.spec"}


def __getattr__(name: str):
    """PEP 562: import the public functions when first asked for."""
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flexengine' has no attribute {name!r}")
