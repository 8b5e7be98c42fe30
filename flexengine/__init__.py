"""flexengine: long-context fine-tuning of HF causal LMs with FlexAttention document masks.

Public API:
    batch = flexengine.pack_documents(docs, seq_len=4096)   # dict of LongTensors [rows, seq_len]
    model = flexengine.patch_attention(model, mode="packed_doc", window=None, backend="auto")
"""

from flexengine.attention.patch import patch_attention
from flexengine.data.packing import pack_documents

__all__ = ["pack_documents", "patch_attention"]
__version__ = "0.1.0"
