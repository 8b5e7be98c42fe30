"""flexengine: long-context fine-tuning of HF causal LMs with FlexAttention document masks.

Public API:
    batch = flexengine.pack_documents(docs, seq_len=4096)   # dict of LongTensors [rows, seq_len]
    model = flexengine.patch_attention(model, mode="packed_doc", backend="auto")   # or, from configs:
    flexengine.apply_attention(model, flexengine.resolve_attention_spec(AttnConfig(...), model.config))
"""

from flexengine.attention.patch import apply_attention, patch_attention
from flexengine.attention.spec import resolve_attention_spec
from flexengine.data.packing import pack_documents

__all__ = ["apply_attention", "pack_documents", "patch_attention", "resolve_attention_spec"]
__version__ = "0.1.0"
