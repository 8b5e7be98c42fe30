"""Tiled MLP: each decoder block's MLP runs over tiles of tokens, each tile a non-reentrant checkpoint, so the
`tokens x intermediate_size` tensors (gate, up, silu(gate), their product: 4 of them, 2.9 GB each for 128K tokens
of a 7B in bf16) only ever exist for one tile -- in forward, and again when backward recomputes that tile.

The MLP acts on every token independently, so tiling changes nothing but the order of the weight-gradient sums
(ALST, Snowflake 2025: "TiledMLP"). Autograd's engine runs the highest sequence number first, and all nodes of a
later tile were created after those of an earlier one, so backward finishes one tile (recompute included) before
it starts the next: one tile's intermediates are alive at a time. Each tile saves only a view of the MLP input,
which the block holds anyway (the post-attention norm's output). Non-reentrant checkpoint stops recomputing
once down_proj's input exists, so the extra work per block is gate_proj + up_proj again: the same FLOPs as
memory.granularity=mlp. Plain `torch.utils.checkpoint` in a Python loop over a static number of tiles: dynamo
traces it inside a compiled block with fullgraph=True, and it nests inside a block checkpoint (memory=full).
flexengine.surgery.memory.policy gives each block's `mlp` the shared MemoryBlock class with MemorySpec(mlp_tile=N).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def auto_tile_tokens(hidden_size: int) -> int:
    """ALST's default: tiles of hidden_size tokens, so a tile's intermediate is ~ the size of the weights' rows."""
    return int(hidden_size)


def tiled_mlp_forward(mlp_forward, x: Tensor, *, tile_tokens: int) -> Tensor:
    """mlp_forward over tiles of `tile_tokens` tokens of x [..., H], each tile recomputed in backward."""
    x_NH = x.reshape(-1, x.shape[-1])  # MLPs act per token: batch and sequence are one axis here
    if x_NH.shape[0] <= tile_tokens:
        return mlp_forward(x)
    outs = [checkpoint(mlp_forward, tile, use_reentrant=False) for tile in x_NH.split(tile_tokens)]
    return torch.cat(outs).view(*x.shape[:-1], -1)
