"""Bytes one forward holds for backward, per decoder block and per batch, and what recomputing them costs.

Activations per decoder block: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", eq. 2) count `sbh(34 + 5as/h)` bytes per layer for a 16-bit GPT block. Adapted to a LLaMA block
(RMSNorm, RoPE, GQA, SwiGLU, no dropout) with fused flash/flex attention, with T = micro_batch x seq_len tokens,
h hidden, a query heads, k kv heads, d head_dim, f intermediate, p bytes per activation element:

    per block = T x [ 2 x ((4 + 2p) h + 4)    two RMSNorms: fp32 input copy, normalised, scaled output, rsqrt
                    + p (2ad + 2kd)            q and k after RoPE, v, attention output
                    + 4a                       attention log-sum-exp (fp32)
                    + 4p f ]                   SwiGLU: gate, silu(gate), up, silu(gate) * up
              (+ T x p ad                      flex: o_proj's contiguous copy of the attention output)
              (+ B S^2 p                       dense backend only: SDPA's float copy of the boolean mask)

RoPE's products save only the shared cos/sin tables (they do not require grad). No [S, S] term: flash/flex
attention keeps O(S) per head, where the published formula's 5as/h term is the S^2 score/softmax/dropout.
Per batch, outside the blocks: rotary cos/sin (2 T d p), the final norm ((4 + p) T h), the loss inputs
(T h p + 16 T) and, unchunked, the fp32 log-probabilities (T V 4); the dense backend's [B, 1, S, S] bool mask
(held by checkpoint closures) once per batch. Validated against flexengine.surgery.memory.meter in tests/memory.

Recompute costs FLOPs plus the bytes its pointwise ops move: SAC keeps every matmul but still re-runs norms, RoPE
and SwiGLU. Which parts and ops each recompute re-runs is defined beside the enum (surgery/memory/spec.py:
`Recompute.flops`, `MemorySpec.recompute_flops`, `pointwise_ops`), shared with loop/flops.py; this module prices
the parts (`block_recompute_parts`, `pointwise_bytes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from flexengine.core.config import MemoryConfig
from flexengine.planning.shapes import ModelShape, PlanInputs, Workload
from flexengine.surgery.attention.spec import AttnBackend
from flexengine.surgery.memory.spec import BlockFlops, MemorySpec, Recompute, block_memory_specs
from flexengine.surgery.memory.tiled_mlp import auto_tile_tokens


def block_inventory(m: ModelShape, w: Workload) -> dict[str, dict[str, int]]:
    """Bytes one block (policy none) holds for backward, by sub-layer and tensor (see the module formula)."""
    T, p, h = w.tokens, w.act_bytes, m.hidden
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim

    def norm() -> dict[str, int]:
        return {"input_fp32": 4 * T * h, "normalised": p * T * h, "scaled_output": p * T * h, "rsqrt": 4 * T}

    # flex saves its K and V inputs: under context parallelism the whole row's, all-gathered (cp x T tokens)
    attention = {
        "q_rope": p * T * ad,
        "k_rope": p * T * w.cp * kd,
        "v": p * T * w.cp * kd,
        "attn_out": p * T * ad,
        "logsumexp": 4 * T * m.heads,
    }
    if w.backend is AttnBackend.FLEX:
        attention["o_proj_input"] = p * T * ad  # CPU flash returns [B, S, H, D] already; flex's copy assumed
    elif w.backend is AttnBackend.DENSE:
        attention["float_mask"] = p * w.dense_mask_elements  # SDPA's float copy of each chunk's bool mask
        if w.seq_len > w.dense_chunk:  # the chunks' outputs are concatenated [B, H, S, D]: o_proj gets a copy
            attention["o_proj_input"] = p * T * ad
    # varlen: its output is already [B, S, H, D], so o_proj's input is a view of attn_out: nothing more
    mlp = {
        "gate": p * T * m.intermediate,
        "silu": p * T * m.intermediate,
        "up": p * T * m.intermediate,
        "down_input": p * T * m.intermediate,
    }
    return {"norm1": norm(), "attention": attention, "norm2": norm(), "mlp": mlp}


def sac_inventory(m: ModelShape, w: Workload) -> dict[str, int]:
    """Bytes one block holds under op-level SAC: its input plus every matmul and attention output."""
    T, p, h = w.tokens, w.act_bytes, m.hidden
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "block_input": p * T * h,
        "q": p * T * ad,
        "k": p * T * kd,
        "v": p * T * kd,
        "attn_out": p * T * ad,
        "logsumexp": 4 * T * m.heads,
        "attn_proj_out": p * T * h,
        "gate": p * T * m.intermediate,
        "up": p * T * m.intermediate,
        "mlp_out": p * T * h,
    }


# The sub-layer of `block_inventory` a sub-module checkpoint re-runs (it keeps only its normalised input)
_RECOMPUTED_PART = {Recompute.ATTENTION: "attention", Recompute.MLP: "mlp"}


def block_bytes(m: ModelShape, w: Workload, spec: MemorySpec) -> tuple[int, int]:
    """(device bytes, host bytes) one block holds under its MemorySpec."""
    inv = block_inventory(m, w)
    if spec.tiles_mlp(w.tokens) and spec.recompute is not Recompute.OPS:
        # per-tile checkpoints keep only views of the MLP input (norm2's output, already counted). Under SAC the
        # tiles' matmul outputs still land in its cache: measured unchanged.
        inv["mlp"] = {}
    if spec.recompute is Recompute.NONE:
        held = sum(sum(part.values()) for part in inv.values())
    elif spec.recompute is Recompute.BLOCK:
        held = w.act_bytes * w.tokens * m.hidden  # the checkpoint's input
    elif spec.recompute is Recompute.OPS:
        held = sum(sac_inventory(m, w).values())
    else:  # attention | mlp: that sub-layer keeps only its (already counted) normalised input
        held = sum(sum(part.values()) for name, part in inv.items() if name != _RECOMPUTED_PART[spec.recompute])
    return (0, held) if spec.offload else (held, 0)


def block_working_bytes(m: ModelShape, w: Workload) -> int:
    """Bytes of one block's tensors re-materialised at once in backward (its recompute, or the activation
    gradients of its size): the whole inventory, whose MLP part also has two gradients of [tokens, intermediate]
    in flight (measured: ~6 such tensors at the MLP's backward peak) -- for one tile when the MLP is tiled."""
    inv = block_inventory(m, w)
    mlp = sum(inv.pop("mlp").values()) * 6 // 4
    tiled = mlp * min(w.mlp_tile, w.tokens) // w.tokens if w.mlp_tiled else mlp
    return sum(sum(part.values()) for part in inv.values()) + tiled


def block_forward_flops(m: ModelShape, w: Workload, attended_fraction: float = 0.5) -> dict[str, float]:
    """Forward FLOPs of one block by matmul (2 per multiply-add); attention core scaled by keys attended."""
    T, h = w.tokens, m.hidden
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {
        "qkv_proj": 2 * T * h * (ad + 2 * kd),
        "attn_out_proj": 2 * T * ad * h,
        "attention_core": 4 * w.micro_batch * m.heads * w.seq_len**2 * m.head_dim * attended_fraction,
        "gate_up_proj": 4 * T * h * m.intermediate,
        "mlp_out_proj": 2 * T * h * m.intermediate,
    }


def pointwise_bytes(m: ModelShape, w: Workload) -> dict[str, int]:
    """Bytes written by the pointwise ops of one block's forward, by op, read from HF's LLaMA code path.

    LlamaRMSNorm: to(fp32), pow, mean, +eps/rsqrt, x*rsqrt (all fp32), to(dtype), weight* (two per block);
    apply_rotary_pos_emb per q/k: x*cos, rotate_half (neg of one half, cat), *sin, add = 4.5 tensors of x's
    size; SwiGLU: silu(gate), *up; two residual adds."""
    T, p, h, f = w.tokens, w.act_bytes, m.hidden, m.intermediate
    ad, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    casts = (4 + p) * h if p < 4 else 0  # to(fp32) and back are no-ops for fp32 activations
    norm = T * ((8 + p) * h + casts + 12)  # pow, x*rsqrt (fp32), weight* (p), mean/+eps/rsqrt (fp32 per token)
    return {
        "norm1": norm,
        "rope": int(4.5 * p * T * (ad + kd)),
        "norm2": norm,
        "swiglu": 2 * p * T * f,
        "residual": 2 * p * T * h,
    }


def block_recompute_parts(
    m: ModelShape, w: Workload, attended_fraction: float = 0.5, count_attention_core: bool = True
) -> BlockFlops:
    """One block's forward FLOPs by the parts a recompute re-runs (no LoRA here: no `*_end` terms).
    count_attention_core=False matches FlopCounterMode on CPU, which has no formula for the CPU flash-attention
    kernel."""
    f = block_forward_flops(m, w, attended_fraction)
    return BlockFlops(
        attention_inputs=f["qkv_proj"],
        attention_core=f["attention_core"] if count_attention_core else 0.0,
        attention_output=f["attn_out_proj"],
        mlp_inputs=f["gate_up_proj"],
    )


def recompute_flops_per_block(
    m: ModelShape,
    w: Workload,
    granularity: Recompute,
    attended_fraction: float = 0.5,
    count_attention_core: bool = True,
) -> float:
    """Extra forward FLOPs backward spends re-running one block checkpointed at `granularity` (`Recompute.flops`)."""
    return granularity.flops(block_recompute_parts(m, w, attended_fraction, count_attention_core))


def constant_bytes(m: ModelShape, w: Workload, checkpointed: bool) -> dict[str, int]:
    """Bytes held once per micro-batch outside the blocks (saved for backward)."""
    T, p = w.tokens, w.act_bytes
    n = w.micro_batch * (w.seq_len - 1)  # next-token targets (all valid: the worst case)
    out = {
        "rotary_cos_sin": 2 * T * m.head_dim * p,
        "final_norm": (4 + p) * T * m.hidden + 4 * T,
        "loss_inputs": n * m.hidden * p + 16 * n,
    }  # hidden rows (lm_head's input), int64 row index
    # (index_select's backward) and int64 targets (cross-entropy's backward); the positions come from the loader
    if w.chunk_size <= 0 or n <= w.chunk_size:
        out["log_probs"] = 4 * n * m.vocab  # CE keeps fp32 log-softmax of all [tokens, vocab]
    if w.backend is AttnBackend.DENSE and checkpointed:
        out["bool_mask"] = w.dense_mask_elements  # the chunks' bool masks, kept alive by the checkpoint closures
    return out


def loss_transient_bytes(m: ModelShape, w: Workload) -> int:
    """Peak extra bytes of lm_head + CE: logits (p), fp32 log-probs and their gradient, for one chunk."""
    n = w.micro_batch * (w.seq_len - 1)
    rows = n if w.chunk_size <= 0 else min(n, w.chunk_size)
    return rows * m.vocab * (w.act_bytes + 4 + 4)


@dataclass
class ActivationEstimate:
    """Planner's counterpart of meter.ActivationReport (holder attribution: a block counts what it saves)."""

    total_bytes: int  # device
    per_block: list[int]
    other_bytes: int
    offloaded_bytes: int
    recompute_flops: float  # extra forward FLOPs per micro-batch (attention core at the given attended fraction)
    recompute_pointwise_bytes: int = 0  # bytes the re-run pointwise ops move per micro-batch (memory-bound)
    offloaded_per_block: list[int] = field(default_factory=list)  # host bytes of each block (0: not offloaded)


def estimate_activations(
    m: ModelShape,
    w: Workload,
    specs: Sequence[MemorySpec],
    attended_fraction: float = 0.5,
    count_attention_core: bool = True,
) -> ActivationEstimate:
    """Bytes a forward under one MemorySpec per block (`memory_specs`) holds for backward, per block and in total."""
    parts, ops = block_recompute_parts(m, w, attended_fraction, count_attention_core), pointwise_bytes(m, w)
    per_block, offloaded, flops, pointwise = [], [], 0.0, 0
    for spec in specs:
        dev, off = block_bytes(m, w, spec)
        per_block.append(dev)
        offloaded.append(off)
        tiled = spec.tiles_mlp(w.tokens)  # every tile re-runs gate_proj + up_proj and SwiGLU in backward
        flops += spec.recompute_flops(parts, tiled)
        # memory-bound: each re-run op's output is written once and read once by its consumer (2x its bytes)
        pointwise += 2 * sum(ops[name] for name in spec.recomputed_pointwise_ops(tiled))
    # Only a checkpoint around attention keeps the attention kwargs (the dense mask) alive in its closure.
    holds_mask = any(spec.recompute.wraps_attention for spec in specs)
    other = sum(constant_bytes(m, w, checkpointed=holds_mask).values())
    return ActivationEstimate(sum(per_block) + other, per_block, other, sum(offloaded), flops, pointwise, offloaded)


def resolve_tiles(memory: MemoryConfig, m: ModelShape) -> MemoryConfig:
    """memory.tiled_mlp=auto as a number: ALST's hidden_size tokens per tile."""
    if memory.tiled_mlp != "auto":
        return memory
    return dataclasses.replace(memory, tiled_mlp=auto_tile_tokens(m.hidden))


def memory_specs(memory: MemoryConfig, m: ModelShape) -> tuple[MemorySpec, ...]:
    """A concrete memory.* (tiled_mlp=auto allowed) as the per-block MemorySpecs every cost reads: the one place
    the planner turns a memory config into specs."""
    return block_memory_specs(resolve_tiles(memory, m), m.layers)


# Not counted under CP: the whole-row block mask ContextParallel.shard builds per window before each micro-batch's
# forward (786,432 tokens: 0.56 GiB of block indices, 1.4 GiB at the peak of building, measured on CPU). It is
# freed before the forward, while no activations exist, so it stays under the step's peak; the per-rank CP masks
# kept through the step are ~75 MB per window at cp 8 (README, "Context parallelism").
def gathered_kv_bytes(m: ModelShape, x: PlanInputs) -> int:
    """Context parallelism: the gradients of one block's all-gathered K and V (the whole row's, before
    flex_cp_allgather's backward reduce-scatters them to this rank's share); 0 without CP. The gathered K and V
    themselves are in the block's inventory (`block_inventory`, Workload.cp)."""
    if x.cp <= 1:
        return 0
    return 2 * x.micro_batch * x.seq_len * m.kv_heads * m.head_dim * x.dtype_bytes
